"""The qwen3 reasoning parser: ``<think>`` blocks split from the answer (whole and streamed, on random
splits of random texts), and through the server on a scripted model that thinks before it answers:
``reasoning_content`` and ``content`` in full and streamed responses, and structured output that
starts after the reasoning (without the parser the grammar leaves the model no way to think)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

import oxibonsai as ob
from oxibonsai.server.reasoning import StreamingReasoningParser, split_reasoning
from oxibonsai.structured_output import GrammarCompiler, StructuredOutputsParams

from scripted_model import write_scripted_model
from server_support import app_for, asgi_client, run, sse_payloads

PIECES = ["<think>", "</think>", "<th", "ink>", "</th", "\n\n", " ", "abc", "x<", "{}", "<", "/"]
SCRIPT = ["<think>", "\nweighing options\n", "</think>", "\n\n", '{"ok": true}', "<|im_end|>"]


def streamed(text: str, rng: random.Random) -> tuple[str, str]:
    """The joined reasoning and content deltas of ``text`` fed in random pieces."""
    parser = StreamingReasoningParser("qwen3")
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    reasoning, content = [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = parser.feed(text[a:b])
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join([*reasoning, r]), "".join([*content, c])


def test_streamed_splits_equal_the_whole_split_on_random_texts():
    rng = random.Random()
    for _ in range(2000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
        if rng.random() < 0.5:
            text = "<think>" + text
        reasoning, content = split_reasoning(text, "qwen3")
        got_reasoning, got_content = streamed(text, rng)
        assert got_content == content, text
        assert (got_reasoning.strip() if reasoning is not None else got_reasoning) == (reasoning or ""), text


def test_split_rules():
    assert split_reasoning("<think>\nhm\n</think>\n\nHi", "qwen3") == ("hm", "Hi")
    assert split_reasoning("Hi <think>x</think>", "qwen3") == (None, "Hi <think>x</think>")
    assert split_reasoning("<think>cut off", "qwen3") == ("cut off", "")
    assert split_reasoning("<think></think>", "qwen3") == ("", "")


def test_the_grammar_waits_for_the_reasoning_and_the_whitespace_after_it():
    tokenizer = ob.LLM(None).tokenizer  # the embedded model's vocabulary has <think> and </think>
    think, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    assert think is not None and end is not None
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, "qwen3")
    state = compiler.compile(StructuredOutputsParams(choice=["yes"]))

    def allowed() -> set[int]:
        mask = state.mask()
        assert mask is not None
        return {t for t in range(tokenizer.vocab_size) if int(mask[t // 32]) >> (t % 32) & 1}

    first = allowed()
    assert (
        think in first and end not in first and all(tokenizer.decode([t]) in "yes" for t in first - {think})
    )
    state.accept([think])
    assert state.reasoning and state.mask() is None
    state.accept(tokenizer.encode(" some thoughts"))
    state.accept([end])
    after = allowed()
    spaces = {t for t in after if not tokenizer.decode([t]).strip()}
    assert spaces and tokenizer.encode("\n\n")[0] in spaces
    state.accept(tokenizer.encode("\n\n") + tokenizer.encode("yes"))
    assert state.done
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        GrammarCompiler(tokenizer, tokenizer.vocab_size, "r1")


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scripted_model(tmp_path_factory.mktemp("thinking") / "m.gguf", SCRIPT)


def chat(app: Any, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full response's message and the stream's joined deltas (with its finish reason)."""

    async def go() -> tuple[Any, Any]:
        async with asgi_client(app) as c:
            full = await c.post("/v1/chat/completions", json=body)
            stream = await c.post("/v1/chat/completions", json={**body, "stream": True})
            return full.json(), sse_payloads(stream.text)

    full, events = run(go())
    joined: dict[str, Any] = {"reasoning_content": "", "content": ""}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            for key in joined:
                joined[key] += choice["delta"].get(key) or ""
    return full["choices"][0]["message"], joined


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_the_server_splits_reasoning_and_constrains_the_answer_after_it(thinking_model, parser):
    engine = ob.AsyncLLM(thinking_model, kv_cache_blocks=64, reasoning_parser=parser)
    try:
        app = app_for(engine, reasoning_parser=parser)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}
        message, joined = chat(app, body)
        if parser is None:
            assert "reasoning_content" not in message
            assert message["content"] == "<think>\nweighing options\n</think>\n\n" + '{"ok": true}'
        else:
            assert (message["reasoning_content"], message["content"]) == ("weighing options", '{"ok": true}')
            assert (joined["reasoning_content"].strip(), joined["content"]) == (
                "weighing options",
                '{"ok": true}',
            )
        constrained, joined = chat(app, {**body, "response_format": {"type": "json_object"}})
        if parser is None:  # the grammar rules out <think>: the model answers JSON at once
            assert constrained["content"].startswith("{")
        else:
            assert constrained == message
            assert json.loads(constrained["content"]) == {"ok": True}
    finally:
        engine.shutdown()

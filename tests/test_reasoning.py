"""The qwen3 reasoning parser: ``<think>`` blocks split from the answer (whole and streamed, on random
splits of random texts, with the block opened by the output or by the prompt), and through the server
on scripted models that think before they answer: ``reasoning`` (and ``reasoning_content``) and
``content`` in full and streamed responses, and structured output that starts after the reasoning
(without the parser the grammar leaves the model no way to think), also where the chat template opens
the block in the prompt (Qwen3-2507's thinking models); an assistant message's earlier reasoning
reaches the template."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

import oxibonsai as ob
from oxibonsai.server.protocol import ChatMessage
from oxibonsai.server.reasoning import StreamingReasoningParser, prompt_opens_reasoning, split_reasoning
from oxibonsai.structured_output import GrammarCompiler, StructuredOutputsParams

from scripted_model import write_scripted_model
from server_support import app_for, asgi_client, run, sse_payloads

PIECES = ["<think>", "</think>", "<th", "ink>", "</th", "\n\n", " ", "abc", "x<", "{}", "<", "/"]
SCRIPT = ["<think>", "\nweighing options\n", "</think>", "\n\n", '{"ok": true}', "<|im_end|>"]


# A template that opens the reasoning block for the model, as Qwen3-2507's thinking models' does, and
# renders an assistant message's earlier reasoning as Qwen3's does.
OPENING_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.reasoning_content %}{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}{{ message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
OPENED_SCRIPT = ["pondering", "</think>", "\n\n", '{"ok": true}', "<|im_end|>"]


def streamed(text: str, rng: random.Random, opened: bool = False) -> tuple[str, str]:
    """The joined reasoning and content deltas of ``text`` fed in random pieces."""
    parser = StreamingReasoningParser("qwen3", opened)
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
        opened = rng.random() < 0.3
        reasoning, content = split_reasoning(text, "qwen3", opened)
        got_reasoning, got_content = streamed(text, rng, opened)
        assert got_content == content, text
        assert (got_reasoning.strip() if reasoning is not None else got_reasoning) == (reasoning or ""), text


def test_split_rules():
    assert split_reasoning("<think>\nhm\n</think>\n\nHi", "qwen3") == ("hm", "Hi")
    assert split_reasoning("Hi <think>x</think>", "qwen3") == (None, "Hi <think>x</think>")
    assert split_reasoning("<think>cut off", "qwen3") == ("cut off", "")
    assert split_reasoning("<think></think>", "qwen3") == ("", "")
    assert split_reasoning("hm\n</think>\n\nHi", "qwen3", opened=True) == ("hm", "Hi")
    assert split_reasoning("still thinking", "qwen3", opened=True) == ("still thinking", "")
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", "qwen3")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", "qwen3")
    assert not prompt_opens_reasoning(None, "qwen3")


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
    joined: dict[str, Any] = {"reasoning": "", "reasoning_content": "", "content": ""}
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
            assert (message["reasoning"], message["content"]) == ("weighing options", '{"ok": true}')
            assert (joined["reasoning"].strip(), joined["content"]) == ("weighing options", '{"ok": true}')
            assert message["reasoning_content"] == message["reasoning"]
            assert joined["reasoning_content"] == joined["reasoning"]
        constrained, joined = chat(app, {**body, "response_format": {"type": "json_object"}})
        if parser is None:  # the grammar rules out <think>: the model answers JSON at once
            assert constrained["content"].startswith("{")
        else:
            assert constrained == message
            assert json.loads(constrained["content"]) == {"ok": True}
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def opened_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scripted_model(
        tmp_path_factory.mktemp("opened") / "m.gguf",
        OPENED_SCRIPT,
        extra_tokens=["<think>"],
        chat_template=OPENING_TEMPLATE,
    )


def test_a_block_the_prompt_opens_is_reasoning_and_the_grammar_waits_for_its_end(opened_model):
    engine = ob.AsyncLLM(opened_model, kv_cache_blocks=64, reasoning_parser="qwen3")
    try:
        app = app_for(engine, reasoning_parser="qwen3")
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}
        message, joined = chat(app, body)
        assert (message["reasoning"], message["content"]) == ("pondering", '{"ok": true}')
        assert (joined["reasoning"].strip(), joined["content"]) == ("pondering", '{"ok": true}')
        constrained, _ = chat(app, {**body, "response_format": {"type": "json_object"}})
        assert constrained == message
    finally:
        engine.shutdown()


def test_an_assistant_messages_reasoning_reaches_the_template():
    for field in ("reasoning", "reasoning_content"):
        msg = ChatMessage.model_validate({"role": "assistant", "content": "A", field: "because"})
        assert msg.for_template()["reasoning_content"] == "because"
    assert "reasoning_content" not in ChatMessage(role="assistant", content="A").for_template()

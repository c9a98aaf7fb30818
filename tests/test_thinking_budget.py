"""``thinking_token_budget``: on a scripted model that thinks four tokens before it answers, the block
closes after exactly the budget (0 to past the block's own length; batched as alone; the native runner,
the torch runner with the Rust sampler and with the torch one), from the output's ``<think>`` or a
prompt that opened the block; sampled requests never think past it; structured output starts after a
forced ``</think>``; the chat and Messages endpoints (``thinking_token_budget``,
``thinking.budget_tokens``) and the command line (``--reasoning-budget``) take it; bad budgets and
vocabularies without the tokens are clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai import structured_output
from oxibonsai.structured_output import StructuredOutputsParams

from scripted_model import write_scripted_model
from server_support import app_for, post

THOUGHTS = ["alpha", "beta", "gamma", "delta"]
SCRIPT = ["<think>", *THOUGHTS, "</think>", "\n\n", '{"ok": true}', "<|im_end|>"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scripted_model(tmp_path_factory.mktemp("budget") / "m.gguf", SCRIPT)


def ids(llm: ob.LLM, texts: list[str]) -> list[int]:
    """Each text's one token (a special one by name, else as the tokenizer encodes it)."""
    out = []
    for text in texts:
        special = llm.tokenizer.token_to_id(text)
        encoded = [special] if special is not None else llm.tokenizer.encode(text, add_special_tokens=False)
        assert len(encoded) == 1, (text, encoded)
        out.append(encoded[0])
    return out


def greedy(budget: int | None, **more: Any) -> ob.SamplingParams:
    return ob.SamplingParams(max_tokens=20, temperature=0, thinking_token_budget=budget, **more)


def expected(llm: ob.LLM, thought: list[str], opened: bool = False) -> list[int]:
    return ids(llm, ([] if opened else ["<think>"]) + thought + SCRIPT[5:])


@pytest.mark.parametrize("runner", ["native", "torch", "torch-sampling"])
def test_the_block_closes_after_the_budget(model, runner, monkeypatch):
    if runner != "native":
        pytest.importorskip("torch")
        # The torch sampler (what a GPU runs) rather than the Rust one on the host.
        monkeypatch.setenv("OXIBONSAI_DEVICE_SAMPLING", "1" if runner == "torch-sampling" else "0")
    llm = ob.LLM(model) if runner == "native" else ob.LLM(model, runner="torch", device="cpu")
    prompt = ids(llm, ["h", "\n"])
    budgets = [None, 0, 1, 2, 3, 4, 9]
    batched = llm.generate([prompt] * len(budgets), [greedy(b) for b in budgets])
    for budget, out in zip(budgets, batched, strict=True):
        thought = THOUGHTS if budget is None else THOUGHTS[:budget]
        assert out.outputs[0].token_ids == expected(llm, thought), budget
        assert out.outputs[0].finish_reason == "stop"
        assert llm.generate([prompt], greedy(budget))[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_a_block_the_prompt_opened_counts_from_the_first_token(model):
    llm = ob.LLM(model)
    prompt = ids(llm, ["h", "\n", "<think>", "\n"])  # whitespace after <think> still opens it
    out = llm.generate([prompt], greedy(2))[0].outputs[0]
    # After the prompt's "\n" the script starts again at <think>, a token inside the open block.
    assert out.token_ids == expected(llm, ["<think>", THOUGHTS[0]], opened=True)
    prompt = ids(llm, ["h", "\n", "<think>"])
    out = llm.generate([prompt], greedy(2))[0].outputs[0]
    assert out.token_ids == expected(llm, THOUGHTS[:2], opened=True)


def test_sampled_requests_never_think_past_the_budget(model):
    """At temperature 8 the script's token is only ~12x as likely as each of 800 others, so the model
    rarely closes the block itself: from a prompt that opened it, it closes within the budget."""
    llm = ob.LLM(model)
    rng = np.random.default_rng()
    (end,) = ids(llm, ["</think>"])
    prompt = ids(llm, ["h", "<think>"])
    budgets = [int(b) for b in rng.integers(0, 6, 12)]
    sampled = {"max_tokens": 24, "temperature": 8.0, "ignore_eos": True}
    params = [
        ob.SamplingParams(**sampled, seed=int(rng.integers(2**32)), thinking_token_budget=b) for b in budgets
    ]
    outs = llm.generate([prompt] * len(params), params)
    for budget, p, out in zip(budgets, params, outs, strict=True):
        tokens = out.outputs[0].token_ids
        closed = tokens.index(end) if end in tokens else len(tokens)
        assert closed <= budget, (budget, tokens)
        assert closed == len(tokens) or tokens[closed] == end
        again = llm.generate([prompt], p)[0].outputs[0].token_ids
        assert again == tokens, "a seeded request with a budget is reproducible"


def test_structured_output_starts_after_a_forced_end(model):
    llm = ob.LLM(model, reasoning_parser="qwen3")
    prompt = ids(llm, ["h", "\n"])
    out = llm.generate([prompt], greedy(1, structured_outputs=StructuredOutputsParams(json_object=True)))
    # The grammar ends the request once the value is complete, before the stop token.
    assert out[0].outputs[0].token_ids == expected(llm, THOUGHTS[:1])[:-1]


def test_bad_budgets_are_clear_errors(model, monkeypatch):
    with pytest.raises(ValueError, match="thinking_token_budget must be >= 0"):
        ob.SamplingParams(thinking_token_budget=-1)
    with pytest.raises(TypeError, match="thinking_token_budget must be an int"):
        ob.SamplingParams(thinking_token_budget=1.5)
    # As for a vocabulary without Qwen3's tokens:
    monkeypatch.setattr(structured_output, "REASONING_TOKENS", {"qwen3": ("<nothink>", "</nothink>")})
    llm = ob.LLM(model)
    with pytest.raises(ValueError, match="no <think> / </think> tokens"):
        llm.generate([[1, 2, 3]], greedy(4))
    assert not llm._engine.has_unfinished()


def test_the_chat_and_messages_endpoints_take_the_budget(model):
    engine = ob.AsyncLLM(model, kv_cache_blocks=64, reasoning_parser="qwen3")
    try:
        app = app_for(engine, reasoning_parser="qwen3")
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}
        r = post(app, "/v1/chat/completions", {**chat, "thinking_token_budget": 2})
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("alphabeta", '{"ok": true}')
        r = post(app, "/v1/chat/completions", {**chat, "thinking_token_budget": -1})
        assert r.status_code == 400 and "thinking_token_budget" in r.text
        messages = {"model": "bonsai", "max_tokens": 20, "messages": chat["messages"], "temperature": 0}
        thinking = {"type": "enabled", "budget_tokens": 3}
        r = post(app, "/v1/messages", {**messages, "thinking": thinking})
        blocks = r.json()["content"]
        assert [b["type"] for b in blocks] == ["thinking", "text"]
        assert (blocks[0]["thinking"], blocks[1]["text"]) == ("alphabetagamma", '{"ok": true}')
    finally:
        engine.shutdown()


def test_the_command_line_takes_the_budget(model):
    llm = ob.LLM(model)
    want = llm.generate(["h<think>"], greedy(1))[0].outputs[0].text
    flags = ["--model", str(model), "--max-tokens", "20", "--temperature", "0", "--reasoning-budget", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "oxibonsai.cli", "generate", "h<think>", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n" and want.startswith("alpha") and "beta" not in want

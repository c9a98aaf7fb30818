"""``truncate_prompt_tokens`` (vLLM's): a prompt longer than the context is cut to its last tokens
instead of refused, giving exactly what those tokens alone give: ``LLM.generate``, ``AsyncLLM``,
``LLM.embed``, and the completions, chat and embeddings endpoints (where the output budget and the
usage count the cut prompt); bad values are clear errors."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import oxibonsai as ob

from server_support import app_for, post


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, 800, n)]


def params(keep: int | None) -> ob.SamplingParams:
    return ob.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, truncate_prompt_tokens=keep)


def test_a_long_prompt_is_cut_to_its_last_tokens(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=128)
    long, keep = random_ids(rng, int(rng.integers(130, 300))), int(rng.integers(1, 120))
    out = llm.generate([long], params(keep))[0]
    alone = llm.generate([long[-keep:]], params(None))[0]
    assert out.prompt_token_ids == long[-keep:]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    short = long[:keep]
    assert llm.generate([short], params(keep + 5))[0].prompt_token_ids == short, "a short prompt is kept"
    with pytest.raises(ValueError, match="context"):
        llm.generate([long], params(None))
    with pytest.raises(ValueError, match="leave room for at least one generated token"):
        llm.generate([long], params(-1))  # -1 keeps the context's length: nothing left to generate
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1, >= 1 or None, got 0"):
        params(0)
    embedded = llm.embed([long], truncate_prompt_tokens=keep)[0]
    assert embedded.prompt_token_ids == long[-keep:]
    assert embedded.outputs.embedding == llm.embed([long[-keep:]])[0].outputs.embedding


def test_async_generate_cuts_the_prompt(tiny_model, rng):
    engine = ob.AsyncLLM(tiny_model, max_model_len=128)
    long = random_ids(rng, 200)

    async def go() -> Any:
        outs = [out async for out in engine.generate(long, params(50))]
        return outs[0], outs[-1]

    try:
        first, last = asyncio.run(go())
        want = ob.LLM(tiny_model, max_model_len=128).generate([long[-50:]], params(None))[0]
        assert first.prompt_token_ids == last.prompt_token_ids == long[-50:]
        assert last.outputs[0].token_ids == want.outputs[0].token_ids
    finally:
        engine.shutdown()


def test_the_endpoints_cut_the_prompt(tiny_model, rng):
    engine = ob.AsyncLLM(tiny_model, max_model_len=128)
    try:
        app = app_for(engine)
        long = random_ids(rng, 300)
        body = {"prompt": long, "max_tokens": 4, "temperature": 0}
        assert post(app, "/v1/completions", body).status_code == 400
        r = post(app, "/v1/completions", {**body, "truncate_prompt_tokens": 100})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
        alone = post(app, "/v1/completions", {**body, "prompt": long[-100:]})
        assert r.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        r = post(app, "/v1/completions", {**body, "truncate_prompt_tokens": 0})
        assert r.status_code == 400 and "truncate_prompt_tokens" in r.text
        chat = {"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 4}
        assert post(app, "/v1/chat/completions", chat).status_code == 400
        r = post(app, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 64})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
        embed = {"input": [long], "truncate_prompt_tokens": 90}
        r = post(app, "/v1/embeddings", embed)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 90
        want = post(app, "/v1/embeddings", {"input": [long[-90:]]}).json()["data"][0]["embedding"]
        assert r.json()["data"][0]["embedding"] == want
        assert post(app, "/v1/embeddings", {"input": [long]}).status_code == 400
    finally:
        engine.shutdown()

"""``/v1/completions`` with ``echo`` and ``logprobs``, as lm-eval-harness's loglikelihood requests send
them: the prompt's tokens lead the legacy logprobs (the first one null), scored as a float64
``log_softmax`` of the model's logits; ``max_tokens`` 0 with ``echo`` returns the prompt alone; the
stream carries the same logprobs as the full response."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import oxibonsai as ob

from server_support import app_for, asgi_client, run, sse_payloads

pytest.importorskip("fastapi")

WORDS = ["the", "model", "returns", "a", "value", "of", "list", "string", "file", "open", "read"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def engine() -> Iterator[ob.AsyncLLM]:
    e = ob.AsyncLLM(None, seed=random.randrange(2**32))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def app(engine: ob.AsyncLLM) -> Any:
    return app_for(engine)


@pytest.fixture(scope="module")
def reference() -> ob.LLM:
    return ob.LLM(None)


def post(app: Any, body: dict[str, Any], stream: bool = False) -> Any:
    async def go() -> Any:
        async with asgi_client(app) as c:
            return await c.post("/v1/completions", json={**body, "stream": stream} if stream else body)

    return run(go())


def prompt_logprobs(reference: ob.LLM, ids: list[int]) -> list[float]:
    logits = reference.logits(ids).astype(np.float64)
    lse = logits.max(axis=1) + np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1))
    return [float(logits[p - 1, ids[p]] - lse[p - 1]) for p in range(1, len(ids))]


def test_echoed_prompt_tokens_lead_the_logprobs(app, engine, reference):
    prompt = words(random.Random(), 7)
    ids = engine.tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    r = post(app, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(prompt_logprobs(reference, ids), abs=2e-5)
    assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][: len(ids)]) == prompt
    assert lp["text_offset"][: len(ids) + 1] == [0, *np.cumsum([len(t) for t in lp["tokens"][: len(ids)]])]
    plain = post(app, {**body, "echo": False}).json()["choices"][0]
    assert choice["text"] == prompt + plain["text"]
    assert lp["token_logprobs"][-1] == pytest.approx(plain["logprobs"]["token_logprobs"][0], abs=1e-6)


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(app, engine, reference):
    prompt = words(random.Random(), 5)
    ids = engine.tokenizer.encode(prompt)
    r = post(app, {"prompt": prompt, "max_tokens": 0, "logprobs": 0, "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == prompt
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        prompt_logprobs(reference, ids), abs=2e-5
    )
    refused = post(app, {"prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and "max_tokens" in refused.text


def test_the_stream_carries_the_full_responses_logprobs(app):
    body = {
        "prompt": words(random.Random(), 6),
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
    }
    full = post(app, body).json()["choices"][0]
    r = post(app, body, stream=True)
    assert r.status_code == 200
    chunks = [c for c in sse_payloads(r.text) if c != "[DONE]" and c["choices"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in joined:
            joined[key] += (c["choices"][0]["logprobs"] or {}).get(key, [])
    assert text == full["text"]
    assert joined["tokens"] == full["logprobs"]["tokens"]
    assert joined["text_offset"] == full["logprobs"]["text_offset"]
    assert joined["token_logprobs"][1:] == pytest.approx(full["logprobs"]["token_logprobs"][1:], abs=1e-6)

"""vLLM's ``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions`` (in process, the
embedded default model): the ``n`` choices of each prompt are its beams, best first, exactly those of
``LLM.beam_search``; a stream carries each beam whole; usage counts the returned beams;
fields beam search does not take, and ``n`` past the widest beam, are 400s naming them; a full
queue is an overload answer and leaves nothing running."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

import oxibonsai as ob

from server_support import app_for, asgi_client, engine_idle, post, run, slow_steps, sse_payloads, wait_until

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def reference() -> ob.LLM:
    return ob.LLM(None)


def words(rng: random.Random) -> str:
    pool = ["the", "time", "was", "set", "in", "a", "module", "and", "its", "value", "is"]
    return " ".join(rng.choice(pool) for _ in range(rng.randint(2, 8)))


def beams(
    reference: ob.LLM, prompt_ids: list[list[int]], n: int, max_tokens: int, penalty: float
) -> list[Any]:
    """(text, finish reason, generated token count) of every prompt's beams, best first."""
    params = ob.BeamSearchParams(beam_width=n, max_tokens=max_tokens, length_penalty=penalty)
    return [
        (b.text, b.finish_reason, len(b.tokens) - len(ids))
        for ids, out in zip(prompt_ids, reference.beam_search(prompt_ids, params), strict=True)
        for b in out.sequences
    ]


def test_completions_choices_are_the_beams_of_each_prompt(default_app, reference):
    rng = random.Random()
    prompts = [words(rng), words(rng)]
    n, max_tokens, penalty = rng.randint(2, 4), rng.randint(3, 8), round(rng.uniform(0.0, 2.0), 3)
    body = {"prompt": prompts, "use_beam_search": True, "n": n, "max_tokens": max_tokens}
    body |= {"length_penalty": penalty, "temperature": 0.7, "seed": 3}  # accepted, as vLLM does
    r = post(default_app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    got = r.json()
    ids = [reference.tokenizer.encode(p) for p in prompts]
    want = beams(reference, ids, n, max_tokens, penalty)
    assert [c["index"] for c in got["choices"]] == list(range(2 * n))
    assert [(c["text"], c["finish_reason"]) for c in got["choices"]] == [w[:2] for w in want]
    assert got["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert got["usage"]["completion_tokens"] == sum(w[2] for w in want)


def test_chat_streams_each_beam_whole(default_app, default_engine, reference):
    rng = random.Random()
    messages = [{"role": "user", "content": words(rng)}]
    body = {"messages": messages, "use_beam_search": True, "n": 3, "max_tokens": rng.randint(3, 8)}
    full = post(default_app, "/v1/chat/completions", body)
    assert full.status_code == 200, full.text
    prompt = default_engine.chat_prompt(messages)["prompt"]
    ids = reference.tokenizer.encode(prompt, add_special_tokens=False)
    want = [w[:2] for w in beams(reference, [ids], 3, body["max_tokens"], 1.0)]
    choices = full.json()["choices"]
    assert [(c["message"]["content"], c["finish_reason"]) for c in choices] == want
    events = sse_payloads(post(default_app, "/v1/chat/completions", {**body, "stream": True}).text)
    assert events[-1] == "[DONE]"
    streamed: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + (
                choice["delta"].get("content") or ""
            )
            if choice.get("finish_reason"):
                finish[choice["index"]] = choice["finish_reason"]
    assert [(streamed[i], finish[i]) for i in range(3)] == want


@pytest.mark.parametrize(
    ("path", "fields", "name"),
    [
        ("/v1/completions", {"stop": ["x"]}, "stop"),
        ("/v1/completions", {"logprobs": 2}, "logprobs"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"top_p": 0.5}, "top_p"),
        ("/v1/completions", {"n": 11}, "n"),
        ("/v1/completions", {"structured_outputs": {"regex": "a+"}}, "structured output"),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"logit_bias": {"3": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "structured output"),
    ],
)
def test_fields_beam_search_does_not_take_are_400(default_app, path, fields, name):
    body: dict[str, Any] = {"use_beam_search": True, "n": 2, "max_tokens": 4, **fields}
    body |= (
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = post(default_app, path, body)
    assert r.status_code == 400, r.text
    assert name in r.json()["error"]["message"]


def test_a_full_queue_is_an_overload_and_leaves_nothing():
    """One request runs (slowly) and one waits: ``max_waiting=1`` is full, so a beam search is refused
    before its response starts; once they are gone it runs."""
    engine = ob.AsyncLLM(None, max_num_seqs=1, max_waiting=1)
    try:
        app = app_for(engine)
        slow_steps(engine, 0.05)
        long = ob.SamplingParams(max_tokens=200, ignore_eos=True)

        async def go() -> tuple[int, int]:
            streams = [engine.generate("hi", long)]
            assert await asyncio.to_thread(wait_until, lambda: engine.metrics()["num_running"] == 1)
            streams.append(engine.generate("there", long))
            assert await asyncio.to_thread(wait_until, lambda: engine.metrics()["num_waiting"] == 1)
            async with asgi_client(app) as c:
                body = {"prompt": "hi there", "use_beam_search": True, "n": 4, "max_tokens": 4}
                refused = (await c.post("/v1/completions", json=body)).status_code
                streamed = await c.post("/v1/completions", json={**body, "stream": True})
            for stream in streams:
                await stream.aclose()
            return refused, streamed.status_code

        assert run(go()) in ((429, 429), (503, 503))
        assert wait_until(lambda: engine_idle(engine))
        ok = post(
            app, "/v1/completions", {"prompt": "hi there", "use_beam_search": True, "n": 2, "max_tokens": 3}
        )
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    finally:
        engine.shutdown()

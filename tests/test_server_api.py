"""The OpenAI-compatible routes in process (httpx over the ASGI app, the embedded default model): every
endpoint, the request fields and the response shapes, streaming, usage and the metrics."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import oxibonsai as ob

from server_support import app_for, asgi_client, post, run, sse_payloads

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def engine() -> Iterator[ob.AsyncLLM]:
    e = ob.AsyncLLM(None, seed=random.randrange(2**32))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def app(engine: ob.AsyncLLM) -> Any:
    return app_for(engine)


def get(app: Any, path: str) -> Any:
    async def go() -> Any:
        async with asgi_client(app) as c:
            return await c.get(path)

    return run(go())


def words(rng: random.Random, n: int) -> str:
    pool = ["the", "module", "function", "returns", "a", "list", "of", "files", "in", "path", "os", "data"]
    return " ".join(rng.choice(pool) for _ in range(n))


def test_models_version_health_ready(app: Any, engine: ob.AsyncLLM) -> None:
    models = get(app, "/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == "bonsai" and card["object"] == "model" and card["owned_by"] == "oxibonsai"
    assert card["max_model_len"] == engine.max_model_len
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", get(app, "/version").json()["version"])
    assert get(app, "/health").json() == {"status": "ok"}
    assert get(app, "/ready").status_code == 200


def test_completion_matches_the_engine_greedy(app: Any, engine: ob.AsyncLLM) -> None:
    prompt = words(random.Random(), 6)
    r = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "bonsai"
    assert body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    llm_ids = engine.tokenizer.encode(prompt)
    expected = ob.LLM(None).generate([llm_ids], ob.SamplingParams(max_tokens=12, temperature=0))[0]
    assert choice["text"] == expected.outputs[0].text
    assert choice["finish_reason"] == expected.outputs[0].finish_reason
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(llm_ids)
    assert usage["completion_tokens"] == len(expected.outputs[0].token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_logit_bias_forces_and_bans_tokens(app: Any, engine: ob.AsyncLLM) -> None:
    word = engine.tokenizer.encode(" data")[-1]
    prompt = words(random.Random(), 5)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    forced = post(app, "/v1/completions", {**body, "logit_bias": {str(word): 100}}).json()
    assert forced["choices"][0]["text"] == engine.tokenizer.decode([word] * 4)
    greedy = ob.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = ob.LLM(None)
    first = llm.generate([prompt], greedy)[0].outputs[0].token_ids[0]
    ban = ob.SamplingParams(**{**vars(greedy), "logit_bias": {first: -100.0}})
    want = llm.generate([prompt], ban)[0].outputs[0]
    assert want.token_ids[0] != first
    banned = post(app, "/v1/completions", {**body, "logit_bias": {str(first): -100}}).json()
    assert banned["choices"][0]["text"] == want.text


def test_prompt_forms_give_one_choice_each(app: Any, engine: ob.AsyncLLM) -> None:
    rng = random.Random()
    texts = [words(rng, 4), words(rng, 5)]
    ids = [engine.tokenizer.encode(t) for t in texts]
    greedy = {"max_tokens": 6, "temperature": 0}
    by_text = post(app, "/v1/completions", {"prompt": texts, **greedy}).json()
    by_ids = post(app, "/v1/completions", {"prompt": ids, **greedy}).json()
    one_id_list = post(app, "/v1/completions", {"prompt": ids[1], **greedy}).json()
    assert [c["index"] for c in by_text["choices"]] == [0, 1]
    assert [c["text"] for c in by_text["choices"]] == [c["text"] for c in by_ids["choices"]]
    assert one_id_list["choices"][0]["text"] == by_ids["choices"][1]["text"]
    assert by_text["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])


def test_echo_prepends_the_prompt(app: Any) -> None:
    prompt = words(random.Random(), 5)
    plain = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
    echoed = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True})
    assert echoed.json()["choices"][0]["text"] == prompt + plain["choices"][0]["text"]


def test_n_samples_share_the_prompt_through_the_prefix_cache(app: Any, engine: ob.AsyncLLM) -> None:
    prompt = words(random.Random(), 90)
    n_prompt = len(engine.tokenizer.encode(prompt))
    before = engine.metrics()["counters"]["prompt_tokens_total"]
    seed = random.randrange(2**31)
    body = {
        "prompt": prompt,
        "max_tokens": 8,
        "n": 4,
        "seed": seed,
        "temperature": 1.0,
        "cache_salt": str(seed),
    }
    r = post(app, "/v1/completions", body).json()
    computed = engine.metrics()["counters"]["prompt_tokens_total"] - before
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert len({c["text"] for c in r["choices"]}) > 1, "samples with seeds seed+i should differ"
    assert r["usage"]["prompt_tokens"] == n_prompt
    assert 4 <= r["usage"]["completion_tokens"] <= 4 * 8
    # The prompt is computed once; the other samples recompute at most its last, partial block.
    assert n_prompt <= computed <= n_prompt + 3 * engine.block_size
    again = post(app, "/v1/completions", body).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in r["choices"]], (
        "seeded n is reproducible"
    )


def test_stop_strings_and_stop_reason(app: Any) -> None:
    prompt = words(random.Random(), 4)
    full = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0}).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the greedy continuation has no usable stop string here")
    r = post(
        app, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": [stop]}
    ).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == text[: text.index(stop)]


def test_completion_logprobs_shape(app: Any) -> None:
    body = {"prompt": words(random.Random(), 4), "max_tokens": 5, "temperature": 0, "logprobs": 3}
    lp = post(app, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 5
    )
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        # The legacy shape keys by text: tokens that decode alike (lone UTF-8 bytes) share a key.
        assert value <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-5), "greedy picks the top token"
        assert tok in top
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_chat_completion_and_logprobs(app: Any, engine: ob.AsyncLLM) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": words(random.Random(), 5)},
    ]
    body = {
        "messages": messages,
        "max_completion_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = post(app, "/v1/chat/completions", body).json()
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    choice = r["choices"][0]
    assert choice["message"]["role"] == "assistant"
    prompt = engine.chat_prompt(messages)
    expected = ob.LLM(None).generate([prompt], ob.SamplingParams(max_tokens=6, temperature=0))[0]
    assert choice["message"]["content"] == expected.outputs[0].text
    assert r["usage"]["prompt_tokens"] == len(prompt["prompt_token_ids"])
    content = choice["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2 and isinstance(entry["bytes"], list)
    plain = post(app, "/v1/chat/completions", {**body, "top_logprobs": None})
    assert all(e["top_logprobs"] == [] for e in plain.json()["choices"][0]["logprobs"]["content"])


def test_developer_role_and_text_parts_render_like_system_and_strings(app: Any) -> None:
    user = words(random.Random(), 4)
    a = {
        "messages": [{"role": "system", "content": "Hi"}, {"role": "user", "content": user}],
        "max_tokens": 5,
    }
    b = {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "user", "content": [{"type": "text", "text": user}]},
        ],
        "max_tokens": 5,
    }
    ta = post(app, "/v1/chat/completions", {**a, "temperature": 0}).json()["choices"][0]["message"]["content"]
    tb = post(app, "/v1/chat/completions", {**b, "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert ta == tb


def stream(app: Any, path: str, body: dict[str, Any]) -> list[Any]:
    async def go() -> Any:
        async with asgi_client(app) as c:
            r = await c.post(path, json={**body, "stream": True})
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            return sse_payloads(r.text)

    return run(go())


def test_completion_stream_equals_the_full_response(app: Any) -> None:
    body = {"prompt": words(random.Random(), 5), "max_tokens": 16, "temperature": 0}
    full = post(app, "/v1/completions", body).json()
    events = stream(app, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 16
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(app: Any) -> None:
    events = stream(app, "/v1/completions", {"prompt": "os", "max_tokens": 4})
    assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])


def test_chat_stream_first_chunk_carries_the_role(app: Any) -> None:
    messages = [{"role": "user", "content": words(random.Random(), 5)}]
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "n": 2, "seed": 7}
    full = post(app, "/v1/chat/completions", body).json()
    events = stream(app, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in mine[1:])
        assert text == full["choices"][i]["message"]["content"]
        assert mine[-1]["finish_reason"] == full["choices"][i]["finish_reason"]
    usage = events[-2]["usage"]  # cached_tokens may differ: the first request cached the prompt
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        k: full["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }


def test_a_stop_string_never_leaks_into_a_chunk(app: Any) -> None:
    prompt = words(random.Random(), 4)
    text = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0}).json()
    text = text["choices"][0]["text"]
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    if len(stop.strip()) < 2:
        pytest.skip("no usable stop string in this continuation")
    events = stream(
        app, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": stop}
    )
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert stop not in streamed and streamed == text[: text.index(stop)]


def test_tokenize_and_detokenize(app: Any, engine: ob.AsyncLLM) -> None:
    text = words(random.Random(), 7)
    r = post(app, "/tokenize", {"prompt": text}).json()
    assert r["tokens"] == engine.tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.max_model_len
    assert post(app, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == text
    messages = [{"role": "user", "content": text}]
    chat = post(app, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == engine.chat_prompt(messages)["prompt_token_ids"]


def test_cache_salt_separates_prefix_cache_hits(app: Any) -> None:
    prompt = words(random.Random(), 60)
    salt = f"tenant-{random.randrange(2**40)}"
    body = {"prompt": prompt, "max_tokens": 1, "cache_salt": salt}
    first = post(app, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    same = post(app, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    other = post(app, "/v1/completions", {**body, "cache_salt": salt + "x"}).json()
    assert first == 0 and same > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_unknown_fields_are_ignored(app: Any) -> None:
    r = post(app, "/v1/completions", {"prompt": "os", "max_tokens": 2, "foo": {"bar": 1}, "user": "u1"})
    assert r.status_code == 200


def test_metrics_have_vllm_aliases_and_http_counters(app: Any) -> None:
    post(app, "/v1/completions", {"prompt": "os", "max_tokens": 2})
    text = get(app, "/metrics").text
    for name in (
        "oxibonsai_requests_finished_total",
        'vllm:num_requests_running{model_name="bonsai",engine="0"}',
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:gpu_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
        "vllm:gpu_prefix_cache_hits_total{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:time_per_output_token_seconds_count{",
        "vllm:e2e_request_latency_seconds_sum{",
        "vllm:cache_config_info{",
        'http_requests_total{handler="/v1/completions",method="POST",status="2xx"}',
        "http_request_duration_seconds_bucket{",
    ):
        assert name in text, name
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    for line in samples:
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})? [-+0-9.eE]+", line), line


# -- /v1/completions with echo and logprobs, as lm-eval-harness's loglikelihood requests send them: the
# prompt's tokens lead the legacy logprobs (the first one null), scored as a float64 log_softmax of the
# model's logits; max_tokens 0 with echo returns the prompt alone; the stream carries the same logprobs.


@pytest.fixture(scope="module")
def reference() -> ob.LLM:
    return ob.LLM(None)


def stream_response(app: Any, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with asgi_client(app) as c:
            return await c.post("/v1/completions", json={**body, "stream": True})

    return run(go())


def prompt_logprobs(reference: ob.LLM, ids: list[int]) -> list[float]:
    logits = reference.logits(ids).astype(np.float64)
    lse = logits.max(axis=1) + np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1))
    return [float(logits[p - 1, ids[p]] - lse[p - 1]) for p in range(1, len(ids))]


def test_echoed_prompt_tokens_lead_the_logprobs(app, engine, reference):
    prompt = words(random.Random(), 7)
    ids = engine.tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(prompt_logprobs(reference, ids), abs=2e-5)
    assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][: len(ids)]) == prompt
    assert lp["text_offset"][: len(ids) + 1] == [0, *np.cumsum([len(t) for t in lp["tokens"][: len(ids)]])]
    plain = post(app, "/v1/completions", {**body, "echo": False}).json()["choices"][0]
    assert choice["text"] == prompt + plain["text"]
    assert lp["token_logprobs"][-1] == pytest.approx(plain["logprobs"]["token_logprobs"][0], abs=1e-6)


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(app, engine, reference):
    prompt = words(random.Random(), 5)
    ids = engine.tokenizer.encode(prompt)
    r = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "logprobs": 0, "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == prompt
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        prompt_logprobs(reference, ids), abs=2e-5
    )
    refused = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and "max_tokens" in refused.text


def test_the_stream_carries_the_full_responses_logprobs(app):
    body = {
        "prompt": words(random.Random(), 6),
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
    }
    full = post(app, "/v1/completions", body).json()["choices"][0]
    r = stream_response(app, body)
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

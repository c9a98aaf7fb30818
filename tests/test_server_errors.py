"""Bad input and security against the in-process app: every error is OpenAI's envelope with the right
status (400, never 422) and names its field; API keys, CORS, body limits, the context-length boundary."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

import oxibonsai as ob

from server_support import app_for, asgi_client, run

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def engine() -> Iterator[ob.AsyncLLM]:
    e = ob.AsyncLLM(None)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def app(engine: ob.AsyncLLM) -> Any:
    return app_for(engine, max_body_bytes=1 << 20)


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def send(app: Any, path: str, content: bytes | None = None, **kw: Any) -> Any:
    async def go() -> Any:
        async with asgi_client(app) as c:
            if content is None and "json" not in kw:
                return await c.request(kw.pop("method", "GET"), path, **kw)
            headers = kw.pop("headers", {"content-type": "application/json"})
            return await c.post(path, content=content, headers=headers, **kw)

    return run(go())


def assert_error(r: Any, status: int, param: str | None = None, contains: str = "") -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err
    assert " at 0x" not in err["message"] and "Traceback" not in err["message"]
    return err


def completion(app: Any, **fields: Any) -> Any:
    return send(app, "/v1/completions", _json({"prompt": "os", "max_tokens": 2, **fields}))


def chat(app: Any, **fields: Any) -> Any:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return send(app, "/v1/chat/completions", _json(body))


@pytest.mark.parametrize("body", [b"{", b"[]", b'"x"', b"null", b"", b'{"prompt": "x",}'])
def test_malformed_or_non_object_bodies_are_400(app: Any, body: bytes) -> None:
    assert_error(send(app, "/v1/completions", body), 400)


def test_wrong_content_type_is_400(app: Any) -> None:
    r = send(
        app, "/v1/completions", b"prompt=x", headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert_error(r, 400, contains="Content-Type")


@pytest.mark.parametrize("body", [b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800"}'])
def test_invalid_utf8_and_lone_surrogates_are_400(app: Any, body: bytes) -> None:
    assert_error(send(app, "/v1/completions", body), 400)


def test_a_body_over_the_limit_is_413_declared_or_chunked(app: Any) -> None:
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    assert_error(send(app, "/v1/completions", big), 413)

    async def chunks() -> Any:
        for _ in range(40):
            yield b"a" * (64 << 10)

    async def go() -> Any:
        async with asgi_client(app) as c:
            return await c.post(
                "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
            )

    assert_error(run(go()), 413)


@pytest.mark.parametrize("value", [-1, 0, 1.5, "10", True])
def test_bad_max_tokens_is_400_naming_it(app: Any, value: Any) -> None:
    assert_error(completion(app, max_tokens=value), 400, "max_tokens")


def test_context_length_boundary(app: Any, engine: ob.AsyncLLM) -> None:
    limit = engine.max_model_len
    rng = random.Random()
    ids = [rng.randrange(100, 1000) for _ in range(limit - 8)]
    ok = send(app, "/v1/completions", _json({"prompt": ids, "max_tokens": 8, "ignore_eos": True}))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 8
    over = send(app, "/v1/completions", _json({"prompt": ids, "max_tokens": 9}))
    err = assert_error(over, 400, "input_tokens", "This model's maximum context length is")
    assert f"{limit - 8} + 9 = {limit + 1} > {limit}" in err["message"]
    full = send(app, "/v1/completions", _json({"prompt": [5] * limit, "max_tokens": 1}))
    assert_error(full, 400, "input_tokens", "maximum context length")
    huge = completion(app, max_tokens=10**12)
    assert_error(huge, 400, "input_tokens", "maximum context length")
    chat_no_room = send(
        app, "/v1/chat/completions", _json({"messages": [{"role": "user", "content": "os " * limit}]})
    )
    assert_error(chat_no_room, 400, "input_tokens")


@pytest.mark.parametrize("n", [0, 10**6, -1])
def test_bad_n_is_400(app: Any, n: int) -> None:
    assert_error(completion(app, n=n), 400, "n")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("seed", 2**63),
        ("priority", 2**70),
        ("min_tokens", -1),
        ("stop_token_ids", [-1]),
        ("logprobs", 6),
        ("temperature", "hot"),
    ],
)
def test_sampling_fields_out_of_range_are_400_naming_the_field(app: Any, field: str, value: Any) -> None:
    assert_error(completion(app, **{field: value}), 400, field)


def test_sampling_params_errors_keep_their_field(app: Any) -> None:
    assert_error(completion(app, max_tokens=2, min_tokens=5), 400, "min_tokens", "max_tokens")


@pytest.mark.parametrize("stop", [[str(i) for i in range(1000)], "", [1, 2]])
def test_bad_stop_is_400(app: Any, stop: Any) -> None:
    assert_error(completion(app, stop=stop), 400, "stop")


def test_top_logprobs_rules(app: Any) -> None:
    assert_error(chat(app, top_logprobs=5), 400, contains="`logprobs` must be set to true")
    assert_error(chat(app, logprobs=True, top_logprobs=21), 400, "top_logprobs")
    assert_error(chat(app, logprobs=True, top_logprobs="5"), 400, "top_logprobs")
    assert chat(app, logprobs=True).status_code == 200


def test_stream_options_without_stream_is_400(app: Any) -> None:
    assert_error(completion(app, stream_options={"include_usage": True}), 400, contains="stream=True")


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        "hello",
        [{"content": "no role"}],
    ],
)
def test_bad_messages_are_400(app: Any, messages: Any) -> None:
    assert_error(send(app, "/v1/chat/completions", _json({"messages": messages})), 400, "messages")


def test_many_bad_messages_give_a_short_answer(app: Any) -> None:
    r = send(app, "/v1/chat/completions", _json({"messages": [{"role": 5}] * 5000}))
    assert_error(r, 400)
    assert len(r.content) < 64 << 10


def test_model_names(app: Any) -> None:
    assert_error(completion(app, model="nope"), 404, "model", "The model `nope` does not exist.")
    assert completion(app, model="bonsai").status_code == 200
    assert completion(app).status_code == 200


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": []},
        {"tool_choice": "auto"},
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": "f"}},
        {"chat_template": "{{ messages }}"},
    ],
)
def test_unsupported_chat_features_are_refused_loudly(app: Any, fields: dict[str, Any]) -> None:
    assert_error(chat(app, **fields), 400)


@pytest.mark.parametrize(
    "bias",
    [{"x": 1}, {"-1": 1}, {"1.5": 1}, {"5": 100.5}, {"5": "up"}, {str(i): 1 for i in range(2049)}],
)
def test_bad_logit_bias_is_400(app: Any, bias: dict[str, Any]) -> None:
    assert_error(completion(app, logit_bias=bias), 400, "logit_bias")


def test_out_of_vocabulary_logit_bias_is_400(app: Any, engine: ob.AsyncLLM) -> None:
    vocab = engine.tokenizer.vocab_size
    assert_error(chat(app, logit_bias={str(vocab): 1}), 400, contains=f"logit_bias token id {vocab}")


@pytest.mark.parametrize("salt", ["", 123])
def test_bad_cache_salt_is_400(app: Any, salt: Any) -> None:
    assert_error(completion(app, cache_salt=salt), 400, "cache_salt")


def test_out_of_vocabulary_token_ids_are_400(app: Any, engine: ob.AsyncLLM) -> None:
    vocab = engine.tokenizer.vocab_size
    assert_error(
        send(app, "/v1/completions", _json({"prompt": [1, vocab + 5]})), 400, contains=str(vocab + 5)
    )
    assert_error(send(app, "/detokenize", _json({"tokens": [vocab]})), 400, "tokens")


def test_unknown_route_and_method_use_the_envelope(app: Any) -> None:
    assert_error(send(app, "/v1/nothing"), 404)
    assert_error(send(app, "/v1/completions", method="GET"), 405)


def test_api_key(engine: ob.AsyncLLM) -> None:
    app = app_for(engine, api_keys=("k1", "k2"))

    def status(path: str, headers: dict[str, str]) -> int:
        return int(send(app, path, headers=headers).status_code)

    assert status("/v1/models", {}) == 401
    assert assert_error(send(app, "/v1/models"), 401)["type"] == "authentication_error"
    assert status("/v1/models", {"Authorization": "Bearer wrong"}) == 401
    assert status("/v1/models", {"Authorization": "Basic k1"}) == 401
    assert status("/v1/models", {"Authorization": "Bearer k1"}) == 200
    assert status("/v1/models", {"Authorization": "bearer k2"}) == 200
    assert status("/v1/models", {"X-Api-Key": "k2"}) == 200
    for path in ("/metrics", "/tokenize", "/version"):
        assert status(path, {}) == 401
    for path in ("/health", "/ready"):
        assert status(path, {}) == 200
    preflight = send(app, "/v1/completions", method="OPTIONS", headers={"Origin": "http://a.example"})
    assert preflight.status_code != 401
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).encode()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):  # Anthropic's envelope on its routes
        r = send(app, path, body, headers={"content-type": "application/json", "x-api-key": "nope"})
        assert r.status_code == 401
        error = r.json()
        assert set(error) == {"type", "error"} and set(error["error"]) == {"type", "message"}
        assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
        ok = send(app, path, body, headers={"content-type": "application/json", "x-api-key": "k1"})
        assert ok.status_code == 200, ok.text


def test_cors_only_when_configured(engine: ob.AsyncLLM) -> None:
    preflight = {
        "Origin": "http://evil.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    closed = send(app_for(engine), "/v1/completions", method="OPTIONS", headers=preflight)
    assert "access-control-allow-origin" not in closed.headers
    open_app = app_for(engine, allowed_origins=("http://ok.example",))
    allowed = send(
        open_app, "/v1/completions", method="OPTIONS", headers={**preflight, "Origin": "http://ok.example"}
    )
    assert allowed.headers.get("access-control-allow-origin") == "http://ok.example"
    refused = send(open_app, "/v1/completions", method="OPTIONS", headers=preflight)
    assert refused.headers.get("access-control-allow-origin") != "http://evil.example"


def test_errors_are_counted_per_endpoint(app: Any) -> None:
    before = app.state.server.http.count("/v1/completions", "POST", "4xx")
    completion(app, max_tokens=-1)
    assert app.state.server.http.count("/v1/completions", "POST", "4xx") == before + 1

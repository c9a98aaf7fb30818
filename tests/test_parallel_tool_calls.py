"""``parallel_tool_calls: false`` with ``tool_choice: "auto"``: a model that would go on calling tools
makes one call and stops where it closes (no tokens spent past it), on ``/v1/chat/completions``
streamed or not, on the Responses API and on Anthropic's ``disable_parallel_tool_use``. The model is
scripted (``scripted_model``) to answer every turn with calls until its token budget ends."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from scripted_model import WEATHER_TOOL, write_scripted_model
from server_support import app_for, post, sse_payloads

pytest.importorskip("fastapi")

CITIES = ["Paris", "Oslo", "Lima", "Kyiv", "Rome", "Cairo"]


@pytest.fixture(scope="module")
def city() -> str:
    return random.choice(CITIES)


@pytest.fixture(scope="module")
def calling_app(tmp_path_factory: pytest.TempPathFactory, city: str) -> Iterator[Any]:
    """An app whose model answers with a call (three tokens), then a newline and another, and so on."""
    import oxibonsai as ob

    call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    script = ["<tool_call>", f"\n{call}\n", "</tool_call>"]
    engine = ob.AsyncLLM(
        write_scripted_model(tmp_path_factory.mktemp("calls") / "m.gguf", script), kv_cache_blocks=64
    )
    yield app_for(engine)
    engine.shutdown()


def chat_body(max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER_TOOL],
        "max_tokens": max_tokens,
        "temperature": 0,
        **fields,
    }


def chat(app: Any, body: dict[str, Any]) -> dict[str, Any]:
    r = post(app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_chat(app: Any, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str, str]:
    """The stream's tool calls, its content and its last finish reason."""
    r = post(app, "/v1/chat/completions", {**body, "stream": True})
    assert r.status_code == 200, r.text
    calls, content, reason = [], "", None
    for chunk in sse_payloads(r.text)[:-1]:
        for choice in chunk["choices"]:
            calls += choice["delta"].get("tool_calls", [])
            content += choice["delta"].get("content") or ""
            reason = choice.get("finish_reason") or reason
    return calls, content, reason


def test_parallel_calls_are_made_unless_turned_off(calling_app, city):
    calls = random.choice([2, 3, 4])
    budget = 4 * calls - 1  # each call three tokens, a newline between calls
    parallel = chat(calling_app, chat_body(budget))
    choice = parallel["choices"][0]
    assert len(choice["message"]["tool_calls"]) == calls
    assert choice["finish_reason"] == "length"

    single = chat(calling_app, chat_body(budget, parallel_tool_calls=False))
    choice = single["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": city}
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "tool_calls" and choice["stop_reason"] is None
    assert single["usage"]["completion_tokens"] == 3  # nothing generated after the call


def test_the_stream_makes_the_same_single_call(calling_app, city):
    body = chat_body(12, parallel_tool_calls=False)
    calls, content, reason = streamed_chat(calling_app, body)
    [call] = calls
    assert json.loads(call["function"]["arguments"]) == {"city": city}
    assert content.strip() == "" and reason == "tool_calls"
    full = chat(calling_app, body)["choices"][0]["message"]["tool_calls"]
    assert [c["function"] for c in full] == [call["function"]]


def test_a_kept_stop_string_still_gives_one_call(calling_app, city):
    choice = chat(calling_app, chat_body(12, parallel_tool_calls=False, include_stop_str_in_output=True))
    [call] = choice["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": city}
    assert choice["choices"][0]["finish_reason"] == "tool_calls"


def test_the_request_own_stop_strings_still_apply(calling_app, city):
    choice = chat(calling_app, chat_body(12, parallel_tool_calls=False, stop=["nowhere", city]))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == city
    assert "tool_calls" not in choice["message"]  # cut inside the call's JSON
    choice = chat(calling_app, chat_body(12, parallel_tool_calls=False, stop=["nowhere"]))["choices"][0]
    assert len(choice["message"]["tool_calls"]) == 1 and choice["finish_reason"] == "tool_calls"


def test_the_responses_api_makes_one_call(calling_app, city):
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    body = {"input": "Weather?", "tools": [tool], "max_output_tokens": 12, "temperature": 0}
    for parallel, want in ((None, 3), (False, 1)):
        fields = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = post(calling_app, "/v1/responses", {**body, **fields})
        assert r.status_code == 200, r.text
        items = [i for i in r.json()["output"] if i["type"] == "function_call"]
        assert len(items) == want
        assert all(json.loads(i["arguments"]) == {"city": city} for i in items)


def test_anthropic_disable_parallel_tool_use_makes_one_call(calling_app, city):
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [tool], "max_tokens": 12}
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    r = post(calling_app, "/v1/messages", {**body, "tool_choice": choice})
    assert r.status_code == 200, r.text
    msg = r.json()
    [use] = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert use["input"] == {"city": city} and msg["stop_reason"] == "tool_use"
    assert msg["usage"]["output_tokens"] == 3

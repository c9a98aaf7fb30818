"""Forced ``tool_choice`` through ``/v1/chat/completions`` (in process, the embedded default model):
``"required"`` and a named function always answer with tool calls of the offered functions whose
arguments follow their parameters schema, checked with plain Python; a function without parameters
gets ``{}``; ``parallel_tool_calls: false`` gives one call; the stream carries the same calls as the
full response; bad choices are 400s."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from server_support import asgi_client, run, sse_payloads

pytest.importorskip("fastapi")

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CLOCK = {"name": "current_time"}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, CLOCK)]


def post(app: Any, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with asgi_client(app) as c:
            return await c.post("/v1/chat/completions", json=body)

    return run(go())


def streamed_calls(app: Any, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    async def go() -> list[Any]:
        async with asgi_client(app) as c:
            return sse_payloads((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)

    calls, reason = [], None
    for chunk in run(go())[:-1]:
        for choice in chunk["choices"]:
            calls += choice["delta"].get("tool_calls", [])
            reason = choice.get("finish_reason") or reason
    return calls, reason


def check_call(function: dict[str, Any]) -> str:
    """The call's function name, after checking its arguments against the tools' parameters."""
    args = json.loads(function["arguments"])
    if function["name"] == "current_time":
        assert args == {}
    else:
        assert function["name"] == "get_weather" and set(args) == {"city", "unit"}
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
        assert args["unit"] in ("celsius", "fahrenheit")
    return str(function["name"])


def request(rng: random.Random, tool_choice: Any, **fields: Any) -> dict[str, Any]:
    city = rng.choice(["Paris", "Oslo", "Lima", "Kyoto"])
    return {
        "messages": [{"role": "user", "content": f"What is the weather in {city}?"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 200,
        "temperature": rng.choice([0, 0.7, 1.0]),
        "seed": rng.randrange(2**32),
        **fields,
    }


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [
        ("required", {"get_weather", "current_time"}),
        ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
        ({"type": "function", "function": {"name": "current_time"}}, {"current_time"}),
    ],
)
def test_forced_choices_answer_with_valid_calls_streamed_or_not(default_app, tool_choice, names):
    rng = random.Random()
    for _ in range(3):
        body = request(rng, tool_choice)
        r = post(default_app, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        want_reason = "stop" if isinstance(tool_choice, dict) else "tool_calls"  # OpenAI's and vLLM's
        assert choice["finish_reason"] == want_reason and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert calls and {check_call(c["function"]) for c in calls} <= names
        if isinstance(tool_choice, dict):
            assert len(calls) == 1
        streamed, reason = streamed_calls(default_app, body)
        assert reason == want_reason
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
        assert [c["index"] for c in streamed] == list(range(len(calls)))


def test_required_without_parallel_calls_makes_exactly_one(default_app):
    rng = random.Random()
    for _ in range(3):
        body = request(rng, "required", parallel_tool_calls=False, n=2)
        for choice in post(default_app, body).json()["choices"]:
            assert len(choice["message"]["tool_calls"]) == 1
            check_call(choice["message"]["tool_calls"][0]["function"])


@pytest.mark.parametrize(
    ("fields", "contains"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of the tools"),
        ({"tool_choice": {"type": "function", "function": "get_weather"}}, "a named tool_choice is"),
        ({"tool_choice": "always"}, "tool_choice must be"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"tool_choice": "required", "structured_outputs": {"regex": "a"}}, "cannot be combined"),
        ({"tool_choice": "required", "tools": None}, "tool_choice needs tools"),
    ],
)
def test_bad_tool_choices_are_400(default_app, fields, contains):
    body = {**request(random.Random(), "auto"), **fields}
    r = post(default_app, body)
    assert r.status_code == 400 and contains in r.json()["error"]["message"], r.text

"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), in process on the embedded
default model and on a scripted model that thinks: the content is what ``/v1/chat/completions`` gives
for the same conversation (text, forced tool calls and their results, JSON output, thinking), with
Anthropic's stop reasons; streamed events are well formed (``message_start`` first, each block
started, filled and stopped in order, ``message_delta`` and ``message_stop`` last) and add up to the
full message; the official ``anthropic`` client parses both forms; errors come in Anthropic's envelope;
random bodies never fail the server."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_structured_output import prompt_words
from test_server_tool_choice import TOOLS, WEATHER, check_call

from server_support import asgi_client, blocks_held, engine_idle, run, typed_events, wait_until

pytest.importorskip("fastapi")

ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"].get("parameters", {"type": "object"})}
    for t in TOOLS
]


def call(app: Any, path: str, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with asgi_client(app) as c:
            return await c.post(path, json=body)

    return run(go())


def message(app: Any, body: dict[str, Any]) -> dict[str, Any]:
    r = call(app, "/v1/messages", body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(app: Any, body: dict[str, Any]) -> dict[str, Any]:
    r = call(app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def text_of(msg: dict[str, Any]) -> str:
    return "".join(b["text"] for b in msg["content"] if b["type"] == "text")


def without_ids(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content blocks without their tool-use ids (new for every request)."""
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def streamed(app: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The message the stream's events build, after checking their order and names."""
    r = call(app, "/v1/messages", {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = typed_events(r.text)
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    msg = events[0]["message"]
    open_index = None
    for e in events[2:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(msg["content"])
            msg["content"].append(dict(e["content_block"]))
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            block, delta = msg["content"][open_index], e["delta"]
            if delta["type"] == "input_json_delta":
                block["json"] = block.get("json", "") + delta["partial_json"]
            else:
                key = "thinking" if delta["type"] == "thinking_delta" else "text"
                block[key] += delta[key]
        else:
            assert e["type"] == "content_block_stop" and e["index"] == open_index
            block = msg["content"][open_index]
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("json"))
            open_index = None
    assert open_index is None
    msg.update(events[-2]["delta"])
    msg["usage"]["output_tokens"] = events[-2]["usage"]["output_tokens"]
    return msg


def test_text_is_the_chat_completion_streamed_or_not(default_app):
    rng = random.Random()
    prompt = prompt_words(rng)
    fields = {"temperature": rng.choice([0, 0.8]), "seed": rng.randrange(2**32)}
    body = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 24,
        **fields,
    }
    msg = message(default_app, body)
    want = chat(
        default_app,
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
            "max_tokens": 24,
            **fields,
        },
    )
    assert (msg["type"], msg["role"], text_of(msg)) == ("message", "assistant", want["message"]["content"])
    assert msg["stop_reason"] == ("max_tokens" if want["finish_reason"] == "length" else "end_turn")
    usage = msg["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 0 and 0 < usage["output_tokens"] <= 24
    again = streamed(default_app, body)
    assert again["content"] == msg["content"] and again["stop_reason"] == msg["stop_reason"]
    assert again["usage"]["output_tokens"] == usage["output_tokens"]


def test_a_stop_sequence_is_reported(default_app, reference_text):
    prompt, text = reference_text
    word = next(w for w in text.split() if w.strip())
    msg = message(
        default_app,
        {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 40,
            "temperature": 0,
            "stop_sequences": [word],
        },
    )
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", word)
    assert text_of(msg) == text[: text.index(word)]


@pytest.fixture(scope="module")
def reference_text(default_app: Any) -> tuple[str, str]:
    prompt = prompt_words(random.Random())
    out = message(
        default_app, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0}
    )
    if not text_of(out).split():
        pytest.skip("the model answered only whitespace")
    return prompt, text_of(out)


def test_forced_tool_use_and_tool_results_continue_as_chat_does(default_app):
    rng = random.Random()
    question = f"Weather in {rng.choice(['Paris', 'Oslo', 'Lima'])}?"
    body = {
        "messages": [{"role": "user", "content": question}],
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "any"},
        "max_tokens": 200,
        "temperature": 0,
    }
    msg = message(default_app, body)
    uses = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert uses and msg["stop_reason"] == "tool_use"
    for use in uses:
        check_call({"name": use["name"], "arguments": json.dumps(use["input"])})
    want = chat(
        default_app,
        {
            "messages": [{"role": "user", "content": question}],
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 200,
            "temperature": 0,
        },
    )
    assert [(u["name"], u["input"]) for u in uses] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want["message"]["tool_calls"]
    ]
    assert without_ids(streamed(default_app, body)["content"]) == without_ids(msg["content"])
    named = message(
        default_app,
        {**body, "tool_choice": {"type": "tool", "name": WEATHER["name"], "disable_parallel_tool_use": True}},
    )
    assert [b["name"] for b in named["content"] if b["type"] == "tool_use"] == [WEATHER["name"]]
    results = [
        {"type": "tool_result", "tool_use_id": u["id"], "content": [{"type": "text", "text": "sunny"}]}
        for u in uses
    ]
    follow = {
        "messages": [
            *body["messages"],
            {"role": "assistant", "content": msg["content"]},
            {"role": "user", "content": results},
        ],
        "tools": ANTHROPIC_TOOLS,
        "max_tokens": 16,
        "temperature": 0,
    }
    calls = [
        {
            "id": u["id"],
            "type": "function",
            "function": {"name": u["name"], "arguments": json.dumps(u["input"])},
        }
        for u in uses
    ]
    chat_messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": text_of(msg), "tool_calls": calls},
    ]
    chat_messages += [{"role": "tool", "tool_call_id": u["id"], "content": "sunny"} for u in uses]
    want = chat(default_app, {"messages": chat_messages, "tools": TOOLS, "max_tokens": 16, "temperature": 0})
    assert text_of(message(default_app, follow)) == (want["message"]["content"] or "")


def test_output_config_format_gives_json(default_app):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": prompt_words(random.Random())}],
        "max_tokens": 60,
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
    }
    msg = message(default_app, body)
    if msg["stop_reason"] == "end_turn":
        assert set(json.loads(text_of(msg))) == {"n"}


def test_count_tokens_counts_the_rendered_prompt(default_app, default_engine):
    messages = [{"role": "user", "content": prompt_words(random.Random())}]
    r = call(default_app, "/v1/messages/count_tokens", {"messages": messages, "system": "Be brief."})
    assert r.status_code == 200, r.text
    prompt = default_engine.chat_prompt([{"role": "system", "content": "Be brief."}, *messages])
    assert r.json() == {"input_tokens": len(prompt["prompt_token_ids"])}


def test_thinking_is_a_thinking_block(thinking_app):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}
    msg = message(thinking_app, body)
    assert msg["content"] == [
        {"type": "thinking", "thinking": "weighing options", "signature": ""},
        {"type": "text", "text": '{"ok": true}'},
    ]
    again = streamed(thinking_app, body)
    assert [b["type"] for b in again["content"]] == ["thinking", "text"]
    assert (
        again["content"][0]["thinking"].strip() == "weighing options"
        and again["content"][1] == msg["content"][1]
    )
    # An earlier turn's thinking block goes back to the template.
    turn = {
        **body,
        "messages": [
            *body["messages"],
            {"role": "assistant", "content": msg["content"]},
            {"role": "user", "content": "ok"},
        ],
    }
    assert message(thinking_app, turn)["stop_reason"] == "end_turn"


def test_the_anthropic_client_parses_messages_and_their_stream(default_app):
    anthropic = pytest.importorskip("anthropic")
    httpx2 = pytest.importorskip("httpx2")

    async def go() -> tuple[Any, Any]:
        transport = httpx2.ASGITransport(app=default_app)
        client = anthropic.AsyncAnthropic(
            base_url="http://testserver",
            api_key="unused",
            max_retries=0,
            http_client=httpx2.AsyncClient(transport=transport, base_url="http://testserver"),
        )
        kwargs: dict[str, Any] = {
            "model": "bonsai",
            "max_tokens": 16,
            "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": prompt_words(random.Random())}],
        }
        full = await client.messages.create(**kwargs)
        async with client.messages.stream(**kwargs) as stream:
            final = await stream.get_final_message()
        return full, final

    full, final = asyncio.run(go())
    assert full.type == "message" and full.content[0].type == "text" and full.usage.output_tokens <= 16
    assert final.content[0].text == full.content[0].text and final.stop_reason == full.stop_reason


@pytest.mark.parametrize(
    ("body", "status", "kind", "message"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": [], "max_tokens": 4}, 400, "invalid_request_error", "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
            400,
            "invalid_request_error",
            "content blocks are of type",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4,
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            400,
            "invalid_request_error",
            "server tools",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4,
                "tool_choice": {"type": "tool"},
                "tools": ANTHROPIC_TOOLS,
            },
            400,
            "invalid_request_error",
            "needs the tool's name",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "model": "claude-nope"},
            404,
            "not_found_error",
            "claude-nope",
        ),
    ],
)
def test_errors_use_anthropics_envelope(default_app, body, status, kind, message):
    r = call(default_app, "/v1/messages", body)
    assert r.status_code == status, r.text
    error = r.json()
    assert (
        error["type"] == "error" and error["error"]["type"] == kind and message in error["error"]["message"]
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"]) | JSON},
    optional={
        "text": JSON,
        "id": JSON,
        "name": JSON,
        "input": JSON,
        "tool_use_id": JSON,
        "content": JSON,
        "thinking": JSON,
    },
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]) | JSON,
        "content": st.text(max_size=8) | st.lists(BLOCK, max_size=3) | JSON,
    }
)
BODY = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3) | JSON},
    optional={
        "system": JSON,
        "tools": JSON,
        "tool_choice": JSON,
        "thinking": JSON,
        "output_config": JSON,
        "stop_sequences": JSON,
        "stream": st.booleans(),
        "temperature": JSON,
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODY, tokens=st.integers(1, 3))
def test_random_bodies_get_an_answer_never_a_failure(default_app, default_engine, body, tokens):
    r = call(default_app, "/v1/messages", {**body, "max_tokens": tokens})
    assert r.status_code in (200, 400), (body, r.status_code, r.text)
    if r.status_code == 400:
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert wait_until(lambda: engine_idle(default_engine)) and blocks_held(default_engine) == 0

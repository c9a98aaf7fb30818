"""OpenAI's Responses API (``/v1/responses``), in process on the embedded default model and on a
scripted model that thinks: the output is what ``/v1/chat/completions`` gives for the same
conversation (text, forced tool calls, structured output, reasoning), streamed events are well formed
(consecutive sequence numbers, each item added, streamed and done, deltas adding up to the final
output) and carry the same output; stored responses continue with ``previous_response_id``, are
returned and deleted; the official ``openai`` client parses both forms; unsupported requests are
400s and unknown ids 404s."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from test_server_structured_output import prompt_words
from test_server_tool_choice import TOOLS, check_call

from server_support import asgi_client, run, typed_events

pytest.importorskip("fastapi")

RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def call(app: Any, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    async def go() -> Any:
        async with asgi_client(app) as c:
            return await c.request(method, path, json=body)

    return run(go())


def respond(app: Any, body: dict[str, Any]) -> dict[str, Any]:
    r = call(app, "POST", "/v1/responses", body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(app: Any, body: dict[str, Any]) -> dict[str, Any]:
    r = call(app, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]
    )


def streamed(app: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events, after checking each ``event:`` line names its payload's type."""
    r = call(app, "POST", "/v1/responses", {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    return typed_events(r.text)


def check_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The final response, after checking the events' order and that their deltas add up to it."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [item["id"] for item in done] and done == final["response"]["output"]
    for index, item in enumerate(done):
        deltas = "".join(
            e["delta"] for e in events if e.get("output_index") == index and e["type"].endswith(".delta")
        )
        if item["type"] == "function_call":
            assert deltas == item["arguments"]
        else:
            assert deltas == item["content"][0]["text"]
    return final["response"]


def test_text_output_is_the_chat_completion_streamed_or_not(default_app):
    rng = random.Random()
    prompt = prompt_words(rng)
    fields = {"temperature": rng.choice([0, 0.8]), "seed": rng.randrange(2**32)}
    body = {"input": prompt, "instructions": "Answer briefly.", "max_output_tokens": 24, **fields}
    response = respond(default_app, body)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}]
    want = chat(default_app, {"messages": messages, "max_tokens": 24, **fields})
    assert text_of(response) == want["message"]["content"]
    assert response["status"] == ("incomplete" if want["finish_reason"] == "length" else "completed")
    usage = response["usage"]
    assert (
        usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        and usage["output_tokens"] <= 24
    )
    final = check_events(streamed(default_app, body))
    assert text_of(final) == text_of(response)
    for key in ("input_tokens", "output_tokens", "total_tokens"):  # cached_tokens: the prompt is cached now
        assert final["usage"][key] == usage[key]


def test_previous_response_id_continues_the_stored_conversation(default_app):
    rng = random.Random()
    first_prompt, second_prompt = prompt_words(rng), prompt_words(rng)
    first = respond(
        default_app,
        {"input": first_prompt, "instructions": "Be terse.", "max_output_tokens": 12, "temperature": 0},
    )
    assert call(default_app, "GET", f"/v1/responses/{first['id']}").json() == first
    second = respond(
        default_app,
        {
            "input": second_prompt,
            "previous_response_id": first["id"],
            "max_output_tokens": 12,
            "temperature": 0,
        },
    )
    messages = [  # the instructions of the first response are not carried over, as in OpenAI's API
        {"role": "user", "content": first_prompt},
        {"role": "assistant", "content": text_of(first)},
        {"role": "user", "content": second_prompt},
    ]
    want = chat(default_app, {"messages": messages, "max_tokens": 12, "temperature": 0})
    assert text_of(second) == want["message"]["content"]
    assert call(default_app, "DELETE", f"/v1/responses/{first['id']}").json()["deleted"] is True
    for method in ("GET", "DELETE"):
        assert call(default_app, method, f"/v1/responses/{first['id']}").status_code == 404
    gone = call(default_app, "POST", "/v1/responses", {"input": "x", "previous_response_id": first["id"]})
    assert gone.status_code == 404 and "previous_response_id" in gone.text
    unstored = respond(default_app, {"input": "x", "max_output_tokens": 2, "store": False})
    assert call(default_app, "GET", f"/v1/responses/{unstored['id']}").status_code == 404


def test_forced_function_calls_are_function_call_items_and_their_outputs_continue(default_app):
    rng = random.Random()
    city = rng.choice(["Paris", "Oslo", "Lima"])
    fields = {"temperature": 0, "max_output_tokens": 200}
    body = {"input": f"Weather in {city}?", "tools": RESPONSE_TOOLS, "tool_choice": "required", **fields}
    response = respond(default_app, body)
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    assert calls and all(check_call(c) for c in calls)
    want = chat(
        default_app,
        {"messages": [{"role": "user", "content": body["input"]}], "tools": TOOLS, "tool_choice": "required",
         "temperature": 0, "max_tokens": 200},
    )  # fmt: skip
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want["message"]["tool_calls"]
    ]
    final = check_events(streamed(default_app, body))
    assert [(c["name"], c["arguments"]) for c in final["output"]] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    # The calls' results go back as function_call_output items: the chat conversation with tool messages.
    items: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_text", "text": body["input"]}]}
    ]
    items += [
        {"type": "function_call", "call_id": c["call_id"], "name": c["name"], "arguments": c["arguments"]}
        for c in calls
    ]
    items += [{"type": "function_call_output", "call_id": c["call_id"], "output": "sunny"} for c in calls]
    after = respond(
        default_app, {"input": items, "tools": RESPONSE_TOOLS, "max_output_tokens": 16, "temperature": 0}
    )
    chat_calls = [
        {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": body["input"]},
        {"role": "assistant", "content": "", "tool_calls": chat_calls},
    ]
    messages += [{"role": "tool", "tool_call_id": c["call_id"], "content": "sunny"} for c in calls]
    want = chat(default_app, {"messages": messages, "tools": TOOLS, "max_tokens": 16, "temperature": 0})
    assert text_of(after) == (want["message"]["content"] or "")


def test_text_format_json_schema_constrains_the_output(default_app):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "count", "schema": schema, "strict": True}
    response = respond(
        default_app,
        {"input": prompt_words(random.Random()), "text": {"format": fmt}, "max_output_tokens": 60},
    )
    if response["status"] == "completed":
        assert set(json.loads(text_of(response))) == {"n"}
    assert response["text"] == {"format": fmt}


def test_reasoning_is_a_reasoning_item_and_counts_its_tokens(thinking_app):
    body = {"input": "hi", "max_output_tokens": 20, "temperature": 0}
    response = respond(thinking_app, body)
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "message"]
    assert response["output"][0]["content"][0]["text"] == "weighing options"
    assert text_of(response) == '{"ok": true}'
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 3  # <think>, text, </think>
    final = check_events(streamed(thinking_app, body))
    assert [item["type"] for item in final["output"]] == kinds and text_of(final) == text_of(response)
    # The reasoning goes back to the template with the next turn.
    second = respond(thinking_app, {**body, "previous_response_id": response["id"]})
    assert second["status"] == "completed"


def test_the_openai_client_parses_responses_and_their_stream(default_app):
    openai = pytest.importorskip("openai")

    async def go() -> tuple[Any, list[Any]]:
        client = openai.AsyncOpenAI(
            base_url="http://testserver/v1",
            api_key="unused",
            http_client=asgi_client(default_app),
            max_retries=0,
        )
        kwargs = {
            "model": "bonsai",
            "input": prompt_words(random.Random()),
            "max_output_tokens": 16,
            "temperature": 0,
        }
        full = await client.responses.create(**kwargs)
        events = [event async for event in await client.responses.create(**kwargs, stream=True)]
        return full, events

    full, events = asyncio.run(go())
    assert full.object == "response" and full.output_text and full.usage.output_tokens <= 16
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == full.output_text


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "function only"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "n": 2}, 400, "one completion"),
        ({"input": [{"type": "image_generation_call"}]}, 400, "an input item is a message or has a type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            400,
            "text only",
        ),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"instructions": "x"}, 400, "input"),
        ({"input": []}, 400, "non-empty list"),
        ({"input": [{"content": "x"}]}, 400, "input.0.message.role"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "call_id"),
        ({"input": "x", "tools": [{"type": "function"}]}, 400, "tools.0.name"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "needs its schema"),
        ({"input": "x", "reasoning": {"effort": "max"}}, 400, "reasoning.effort"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice needs tools"),
        ({"input": "x", "previous_response_id": "resp_nope"}, 404, "resp_nope"),
    ],
)
def test_unsupported_or_malformed_requests_are_refused(default_app, body, status, message):
    r = call(default_app, "POST", "/v1/responses", body)
    assert r.status_code == status, r.text
    assert message in r.text


def test_the_model_name_is_checked(default_app):
    r = call(default_app, "POST", "/v1/responses", {"input": "x", "model": "nope"})
    assert r.status_code == 404

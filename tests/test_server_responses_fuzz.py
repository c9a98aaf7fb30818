"""Random bodies for ``/v1/responses`` (hypothesis: arbitrary JSON in every field, and well-formed
items with arbitrary values): the server answers 200, or a 400/404 in OpenAI's error envelope, and
never fails (a 500) or leaves a request in the engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_support import asgi_client, blocks_held, engine_idle, run, wait_until

pytest.importorskip("fastapi")

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "text", "input_image"]) | JSON, "text": JSON}
)
ITEM = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | JSON,
         "content": st.text(max_size=12) | st.lists(PART, max_size=2) | JSON}
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "message", "other"]),
         "call_id": JSON, "name": JSON, "arguments": JSON, "output": JSON, "content": JSON}
    ),
    JSON,
)  # fmt: skip
TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "web_search"]) | JSON, "name": st.text(max_size=6) | JSON},
    optional={"parameters": JSON, "description": JSON},
)
BODY = st.fixed_dictionaries(
    {"input": st.text(max_size=12) | st.lists(ITEM, max_size=4) | JSON},
    optional={
        "instructions": st.text(max_size=8) | JSON,
        "tools": st.lists(TOOL, max_size=2) | JSON,
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON,
        "text": st.fixed_dictionaries({"format": JSON}) | JSON,
        "reasoning": JSON,
        "top_logprobs": JSON,
        "store": st.booleans() | JSON,
        "previous_response_id": JSON,
        "stream": st.booleans(),
        "temperature": JSON,
        "n": JSON,
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODY, tokens=st.integers(1, 3))
def test_random_bodies_get_an_answer_never_a_failure(default_app, default_engine, body, tokens):
    body = {**body, "max_output_tokens": tokens}

    async def go() -> Any:
        async with asgi_client(default_app) as c:
            return await c.post(
                "/v1/responses", content=json.dumps(body), headers={"content-type": "application/json"}
            )

    r = run(go())
    assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["code"] == r.status_code and isinstance(error["message"], str)
    assert wait_until(lambda: engine_idle(default_engine)) and blocks_held(default_engine) == 0

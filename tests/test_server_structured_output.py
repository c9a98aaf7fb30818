"""Structured output through the OpenAI-compatible routes (in process, the embedded default model):
``response_format`` (``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` on both
endpoints give what the engine gives with the same ``StructuredOutputsParams``, streamed or not;
conflicting, malformed and uncompilable specifications are 400s naming the problem."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

import oxibonsai as ob
from oxibonsai.structured_output import StructuredOutputsParams

from server_support import asgi_client, post, run, sse_payloads

pytest.importorskip("fastapi")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "year": {"type": "integer"}},
    "required": ["city", "year"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def reference() -> ob.LLM:
    return ob.LLM(None)


def streamed_text(app: Any, path: str, body: dict[str, Any], key: str) -> str:
    async def go() -> list[Any]:
        async with asgi_client(app) as c:
            r = await c.post(path, json={**body, "stream": True})
            return sse_payloads(r.text)

    events = run(go())
    assert events[-1] == "[DONE]"
    parts = []
    for chunk in events[:-1]:
        for choice in chunk.get("choices", []):
            piece = choice["delta"].get("content") if key == "delta" else choice.get("text")
            parts.append(piece or "")
    return "".join(parts)


def prompt_words(rng: random.Random) -> str:
    pool = ["the", "city", "was", "founded", "in", "year", "and", "its", "name", "is"]
    return " ".join(rng.choice(pool) for _ in range(rng.randint(2, 8)))


def test_chat_json_schema_is_the_engines_constrained_output(default_app, default_engine, reference):
    app, engine = default_app, default_engine
    messages = [{"role": "user", "content": prompt_words(random.Random())}]
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    body = {"messages": messages, "max_tokens": 60, "temperature": 0, "response_format": fmt}
    r = post(app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    params = ob.SamplingParams(
        max_tokens=60, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    want = reference.generate([engine.chat_prompt(messages)], params)[0].outputs[0]
    assert choice["message"]["content"] == want.text
    if choice["finish_reason"] == "stop":
        value = json.loads(want.text)
        assert set(value) == {"city", "year"} and type(value["year"]) is int
    assert streamed_text(app, "/v1/chat/completions", body, "delta") == want.text


def test_completions_json_object_and_the_structured_outputs_extension(default_app, reference):
    app = default_app
    rng = random.Random()
    extension = [{"regex": "[0-9]{2}-[a-z]{3}"}, {"choice": ["north", "south"]}, {"json": SCHEMA}]
    extension.append({"grammar": 'root ::= "v" [0-9]+'})
    cases = [({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True))]
    cases += [({"structured_outputs": e}, StructuredOutputsParams(**e)) for e in extension]
    for fields, spec in cases:
        prompt = prompt_words(rng)
        seed = rng.randrange(2**32)
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0.8, "seed": seed, **fields}
        r = post(app, "/v1/completions", body)
        assert r.status_code == 200, r.text
        params = ob.SamplingParams(max_tokens=40, temperature=0.8, seed=seed, structured_outputs=spec)
        want = reference.generate([prompt], params)[0].outputs[0]
        assert r.json()["choices"][0]["text"] == want.text, fields
        assert streamed_text(app, "/v1/completions", body, "text") == want.text
    choice = post(app, "/v1/completions", {"prompt": "x", "n": 3, **cases[2][0]}).json()["choices"]
    assert all(c["text"] in ("north", "south") and c["finish_reason"] == "stop" for c in choice)
    regex = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 40, **cases[1][0]}).json()
    if regex["choices"][0]["finish_reason"] == "stop":
        assert re.fullmatch("[0-9]{2}-[a-z]{3}", regex["choices"][0]["text"])


def test_structural_tags_on_both_endpoints_are_the_engines_output(default_app, default_engine, reference):
    """vLLM's ``structural_tag`` as a ``response_format`` (chat) and in ``structured_outputs`` as JSON
    text (completions); a bias on ``<think>`` (token 3 of the default model) makes segments common."""
    app, rng = default_app, random.Random()
    small = {"type": "integer", "minimum": 0, "maximum": 99}
    tags = {"structures": [{"begin": "<think>", "schema": small, "end": "</think>"}], "triggers": ["<think>"]}
    spec = StructuredOutputsParams(structural_tag=tags)
    seed = rng.randrange(2**32)
    common = {"max_tokens": 30, "temperature": 0.9, "seed": seed, "logit_bias": {"3": 30}}
    params = ob.SamplingParams(
        max_tokens=30, temperature=0.9, seed=seed, logit_bias={3: 30}, structured_outputs=spec
    )
    messages = [{"role": "user", "content": prompt_words(rng)}]
    chat = {"messages": messages, **common, "response_format": {"type": "structural_tag", **tags}}
    prompt = prompt_words(rng)
    completion = {"prompt": prompt, **common, "structured_outputs": {"structural_tag": json.dumps(tags)}}
    for path, body, text, key in (
        ("/v1/chat/completions", chat, default_engine.chat_prompt(messages), "delta"),
        ("/v1/completions", completion, prompt, "text"),
    ):
        r = post(app, path, body)
        assert r.status_code == 200, r.text
        want = reference.generate([text], params)[0].outputs[0].text
        choice = r.json()["choices"][0]
        assert (choice["message"]["content"] if key == "delta" else choice["text"]) == want
        assert streamed_text(app, path, body, key) == want
        segments = re.findall("<think>(.*?)</think>", want, flags=re.S)
        assert segments and all(0 <= int(v) <= 99 for v in segments), want


@pytest.mark.parametrize(
    ("fields", "contains"),
    [
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "not both",
        ),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        ({"response_format": {"type": "structural_tag"}}, "triggers"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}}, "'format' form"),
        ({"structured_outputs": {"structural_tag": '{"triggers": ["<a"]}'}}, "structures"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"structured_outputs": {}}, "exactly one of"),
        ({"structured_outputs": {"regexp": "a"}}, "regexp"),
        ({"structured_outputs": {"choice": "a"}}, "choice"),
        ({"structured_outputs": {"regex": "(a"}}, "invalid structured output"),
        ({"structured_outputs": {"json": "{oops"}}, "not a valid JSON schema"),
    ],
)
def test_bad_specifications_are_400(default_app, fields, contains):
    app = default_app
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = post(app, path, {**body, **fields})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert contains in error["message"] or contains == error.get("param"), error


def test_grammars_compile_off_the_event_loop_before_submission(default_engine):
    """``Samples.start`` compiles each grammar in a worker thread first (``prepare_structured_output``);
    ``generate`` then finds it in the cache, and a bad one fails there, before anything is queued."""
    spec = StructuredOutputsParams(regex=f"[a-z]{{3}}-[0-9]{{{random.randrange(1, 1000)}}}")
    compiler = default_engine._engine._grammars
    assert spec.key() not in compiler._compiled
    default_engine.prepare_structured_output(ob.SamplingParams(structured_outputs=spec))
    assert spec.key() in compiler._compiled
    default_engine.prepare_structured_output(ob.SamplingParams())  # nothing to compile
    with pytest.raises(ValueError, match="invalid structured output"):
        default_engine.prepare_structured_output(ob.SamplingParams(structured_outputs={"regex": "(a"}))

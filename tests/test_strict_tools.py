"""Strict tools (OpenAI's ``strict: true`` functions) with ``tool_choice`` ``"auto"``: the model may
answer in text, but a ``<tool_call>`` it opens must be one call of an offered function, a strict one's
arguments following its parameters (any object for the others), in Qwen3's layout.

The grammar is checked token by token, on the embedded model's vocabulary (``<tool_call>`` is text
there) and on a scripted Qwen3-like one (``<tool_call>`` is an added token): free text, and calls as
Qwen3's template writes them, pass; arguments that break a strict schema are refused at the first
wrong token, while a non-strict tool takes any object. Through ``/v1/chat/completions`` a strict tool
constrains the request (a non-strict one, ``"none"`` and structured output leave it as it was), the
prompt shows the tools without ``strict``, and a strict request answers."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai.server.forced_tools import strict_calls_tag
from oxibonsai.server.protocol import ChatCompletionRequest
from oxibonsai.structured_output import GrammarState, StructuredOutputsParams

from scripted_model import write_scripted_model
from server_support import post

WEATHER = {
    "name": "get_weather",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
LOOSE = {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
FUNCTIONS = [WEATHER, LOOSE]


@pytest.fixture(scope="module")
def llms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ob.LLM]:
    scripted = write_scripted_model(
        tmp_path_factory.mktemp("strict") / "m.gguf", ["<tool_call>", "</tool_call>"]
    )
    return {"embedded": ob.LLM(None), "qwen3-like": ob.LLM(scripted)}


def grammar(llm: ob.LLM) -> GrammarState:
    return llm._engine._grammars.compile(StructuredOutputsParams(structural_tag=strict_calls_tag(FUNCTIONS)))


def allows(state: GrammarState, token: int) -> bool:
    mask = state.mask()
    assert mask is not None
    return bool(int(mask[token // 32]) >> (token % 32) & 1)


def take(state: GrammarState, tokens: list[int]) -> int | None:
    """Feeds ``tokens`` while each is allowed; the index of the first refused one."""
    for i, token in enumerate(tokens):
        if not allows(state, token):
            return i
        state.accept([token])
    return None


def call(name: str, arguments: dict) -> str:
    """A call as Qwen3's chat template writes it."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def words(rng: random.Random) -> str:
    return " ".join(rng.choice(["the", "weather", "is", "in", "a", "city"]) for _ in range(rng.randint(0, 6)))


@pytest.mark.parametrize("vocab", ["embedded", "qwen3-like"])
def test_text_and_well_formed_calls_pass(llms, vocab):
    llm, rng = llms[vocab], random.Random()
    text = words(rng) + call(
        "get_weather", {"city": rng.choice(["Oslo", "Lima"]), "days": rng.randint(-9, 99)}
    )
    text += "\n" + call("search", {"q": words(rng), "any": [1, {"x": None}]}) + words(rng)
    state = grammar(llm)
    assert take(state, llm.tokenizer.encode(text, add_special_tokens=False)) is None, text
    assert allows(state, sorted(llm.tokenizer.stop_token_ids)[0])


@pytest.mark.parametrize("vocab", ["embedded", "qwen3-like"])
@pytest.mark.parametrize(
    ("bad", "where"),
    [
        (call("get_weather", {"city": "Oslo", "days": "two"}), '"two"'),  # a string for an integer
        (call("get_weather", {"town": "Oslo", "days": 2}), '"town"'),  # a property it does not have
        (call("get_time", {}), 'time"'),  # a function not offered
        (call("search", {"q": "x"}).replace(": ", ":", 1), ':"search"'),  # not the template's layout
    ],
)
def test_a_call_breaking_its_strict_schema_is_refused_where_it_breaks(llms, vocab, bad, where):
    llm = llms[vocab]
    ids = llm.tokenizer.encode(bad, add_special_tokens=False)
    at = take(grammar(llm), ids)
    assert at is not None, bad
    taken = len(llm.tokenizer.decode(ids[:at], skip_special_tokens=False))
    assert bad.index(where) - 2 <= taken <= bad.index(where) + len(where), (bad[:taken], where)


def test_a_model_may_think_before_a_call_without_a_reasoning_parser(llms):
    llm = llms["qwen3-like"]
    text = "<think>\nthe user wants the weather\n</think>\n\n" + call(
        "get_weather", {"city": "Oslo", "days": 1}
    )
    assert take(grammar(llm), llm.tokenizer.encode(text, add_special_tokens=False)) is None


def test_the_qwen3_like_vocabulary_asks_for_the_added_tokens(llms):
    llm = llms["qwen3-like"]
    tok = llm.tokenizer
    open_id, close_id = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    state = grammar(llm)
    assert allows(state, open_id)
    assert (
        take(state, tok.encode(call("search", {})[: -len("\n</tool_call>")], add_special_tokens=False))
        is None
    )
    state.accept(tok.encode("\n", add_special_tokens=False))
    assert allows(state, close_id) and not allows(state, tok.encode("</", add_special_tokens=False)[0])


def sampling(body: dict) -> ob.SamplingParams:
    return ChatCompletionRequest.model_validate_json(json.dumps(body)).sampling_params(16, None)


def test_strict_tools_constrain_the_request_and_others_do_not():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    strict = sampling({**base, "tools": tools}).structured_outputs
    assert strict is not None and strict.structural_tag == strict_calls_tag(FUNCTIONS)
    loose = [{"type": "function", "function": LOOSE}]
    assert sampling({**base, "tools": loose}).structured_outputs is None
    assert sampling({**base, "tools": tools, "tool_choice": "none"}).structured_outputs is None
    formatted = sampling({**base, "tools": tools, "response_format": {"type": "json_object"}})
    assert formatted.structured_outputs == StructuredOutputsParams(json_object=True)
    shown = ChatCompletionRequest.model_validate_json(json.dumps({**base, "tools": tools})).template_tools()
    assert shown is not None and all("strict" not in t["function"] for t in shown)


def test_a_strict_request_answers_and_any_call_it_makes_follows_the_schema(default_app):
    rng = np.random.default_rng()
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    body = {"messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": tools, "max_tokens": 40}
    body |= {"temperature": 1.0, "seed": int(rng.integers(2**32)), "n": 3}
    r = post(default_app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        for c in choice["message"].get("tool_calls") or []:
            args = json.loads(c["function"]["arguments"])
            if c["function"]["name"] == "get_weather":
                assert set(args) == {"city", "days"} and type(args["days"]) is int


def test_responses_and_messages_tools_pass_strict_on():
    from oxibonsai.server.anthropic_protocol import MessagesRequest
    from oxibonsai.server.responses_protocol import ResponsesRequest

    fn = {"name": "get_weather", "parameters": WEATHER["parameters"], "strict": True}
    responses = ResponsesRequest.model_validate_json(
        json.dumps({"input": "hi", "tools": [{"type": "function", **fn}]})
    )
    messages = MessagesRequest.model_validate_json(
        json.dumps(
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"], "strict": True}],
            }
        )
    )
    for chat in (responses.chat_request([]), messages.chat_request()):
        assert chat.tools is not None and chat.tools[0].function.strict is True
        spec = chat.sampling_params(8, None).structured_outputs
        assert spec is not None and spec.structural_tag is not None

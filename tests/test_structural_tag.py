"""Structural tags (vLLM's ``structural_tag``): free text whose tagged segments follow JSON schemas.

The grammar is checked token by token on the tiny model's vocabulary: random free text passes, a text
trigger split over several tokens forces the rest of its ``begin``, a segment that breaks its schema is
refused at the first wrong token, and an ``end`` that is an added token (``</think>``) is asked for as
that token, not as text. End to end, the engine's tokens are the reference masked draws (the replay of
``test_structured_output``), with a logit bias that makes the model open segments often, and every
closed segment parses as its schema. Free text may hold added tokens other than triggers. Bad
specifications fail when the parameters are built and, on the server, are 400s naming the problem."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from test_structured_output import allows, random_text_prompts, replay

import oxibonsai as ob
from oxibonsai.structured_output import GrammarState, StructuredOutputsParams

from scripted_model import write_scripted_model

SMALL = {"type": "integer", "minimum": -99, "maximum": 99}  # bounded: random models repeat digits
NUMBER = {"type": "object", "properties": {"n": SMALL}, "required": ["n"], "additionalProperties": False}
TOKEN_TAG = {
    "structures": [{"begin": "<think>", "schema": NUMBER, "end": "</think>"}],
    "triggers": ["<think>"],
}
TEXT_TAGS = {
    "structures": [
        {"begin": "<fn=add>", "schema": NUMBER, "end": "</fn>"},
        {"begin": "<fn=neg>", "schema": SMALL, "end": "</fn>"},
    ],
    "triggers": ["<fn="],
}
WORDS = ["the", "and", " you", " is", "of", "a", "user", "Hi", "\n", " 12", "{", "<"]


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> ob.LLM:
    return ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4)


def grammar(llm: ob.LLM, tags: dict, **more: bool) -> GrammarState:
    return llm._engine._grammars.compile(StructuredOutputsParams(structural_tag=tags, **more))


def take(state: GrammarState, tokens: list[int]) -> int | None:
    """Feeds ``tokens`` one by one while each is allowed; the index of the first refused one."""
    for i, token in enumerate(tokens):
        if not allows(state.mask(), token):
            return i
        state.accept([token])
    return None


def free_text(rng: np.random.Generator) -> str:
    return "".join(rng.choice(WORDS, int(rng.integers(0, 10))))


def test_free_text_and_well_formed_segments_pass(llm, rng):
    tok = llm.tokenizer
    for _ in range(4):
        n = int(rng.integers(-99, 100))
        text = f'{free_text(rng)}<fn=add>{{"n": {n}}}</fn>{free_text(rng)}<fn=neg>{-n}</fn>{free_text(rng)}'
        state = grammar(llm, TEXT_TAGS)
        assert take(state, tok.encode(text, add_special_tokens=False)) is None, text
        stop = sorted(tok.stop_token_ids)[0]
        assert allows(state.mask(), stop)  # the text may end after a closed segment


def test_a_text_trigger_split_over_tokens_forces_its_begin_and_schema(llm, rng):
    tok = llm.tokenizer
    head = free_text(rng) + "<fn="
    state = grammar(llm, TEXT_TAGS)
    assert take(state, tok.encode(head, add_special_tokens=False)) is None
    allowed = [i for i in range(tok.vocab_size) if allows(state.mask(), i)]
    # Only the continuations of "add>" or "neg>" remain.
    assert allowed and all(
        ("add>".startswith(t) or "neg>".startswith(t)) for t in map(tok.decode, [[i] for i in allowed])
    )
    bad = tok.encode(head + "add>[1]</fn>", add_special_tokens=False)
    fresh = grammar(llm, TEXT_TAGS)
    refused = take(fresh, bad)
    assert refused is not None and tok.decode(bad[refused:]).startswith("[")


def test_an_added_token_trigger_and_end_are_asked_for_as_tokens(llm, rng):
    tok = llm.tokenizer
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert think in tok.added_tokens.values() and end in tok.added_tokens.values()
    state = grammar(llm, TOKEN_TAG)
    n = int(rng.integers(-99, 100))
    body = tok.encode(f'{{"n": {n}}}', add_special_tokens=False)
    assert take(state, [*tok.encode(free_text(rng), add_special_tokens=False), think, *body]) is None
    assert allows(state.mask(), end)
    spelled = tok.encode("</think", add_special_tokens=False)  # the text in ordinary pieces
    assert spelled[0] != end and not allows(state.mask(), spelled[0])
    state.accept([end])
    assert not state.done and allows(state.mask(), think)  # free text again, and another segment


def test_free_text_may_hold_added_tokens_other_than_triggers(llm, rng):
    """``<think>``/``</think>`` (added tokens here) pass in free text; with ``<think>`` the trigger, a
    ``<think>`` always opens a segment (then JSON must follow), while ``</think>`` stays free."""
    tok = llm.tokenizer
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    text = tok.encode(free_text(rng), add_special_tokens=False)
    state = grammar(llm, TEXT_TAGS)
    assert take(state, [think, *text, end, *tok.encode("<fn=neg>7</fn>", add_special_tokens=False)]) is None
    state = grammar(llm, TOKEN_TAG)
    assert take(state, [*text, end, think]) is None
    assert not allows(state.mask(), end) and not allows(state.mask(), think)


def closed_segments(text: str, begin: str, end: str) -> list[str]:
    return re.findall(re.escape(begin) + "(.*?)" + re.escape(end), text, flags=re.S)


def test_tokens_are_the_reference_masked_draws_and_segments_match(llm, rng):
    tok = llm.tokenizer
    think = tok.token_to_id("<think>")
    prompts = random_text_prompts(rng, 3)
    seen = 0
    for temperature in (0.0, float(rng.uniform(0.6, 1.2))):
        params = ob.SamplingParams(
            max_tokens=48,
            temperature=temperature,
            seed=int(rng.integers(0, 2**63)),
            logit_bias={think: 30.0},
            skip_special_tokens=False,
            structured_outputs=StructuredOutputsParams(structural_tag=TOKEN_TAG, disable_any_whitespace=True),
        )
        for prompt, result in zip(prompts, llm.generate(prompts, params), strict=True):
            out = result.outputs[0]
            replay(llm, tok.encode(prompt), out, params)
            for segment in closed_segments(out.text, "<think>", "</think>"):
                value = json.loads(segment)
                assert set(value) == {"n"} and type(value["n"]) is int and abs(value["n"]) <= 99, segment
                seen += 1
    assert seen > 0, "the bias should open segments"


@pytest.mark.parametrize(
    ("tags", "message"),
    [
        ({"structures": [{"begin": "<a>", "schema": {}}]}, "triggers"),
        ({"triggers": ["<a"]}, "structures"),
        ({"structures": [{"begin": "<b>", "schema": {}}], "triggers": ["<a"]}, "none of the triggers"),
        ({"structures": [{"begin": "<a>"}], "triggers": ["<a"]}, "schema"),
        ({"structures": [{"begin": "<a>", "schema": "{oops"}], "triggers": ["<a"]}, "not valid JSON"),
        ({"structures": [{"begin": "<a>", "schema": {}, "stop": "x"}], "triggers": ["<a"]}, "'stop'"),
        ({"format": {"type": "any_text"}}, "'format' form"),
        ({"structures": [], "triggers": ["<a"]}, "structures"),
        ({"structures": [{"begin": "<a>", "schema": {}}], "triggers": [""]}, "non-empty string"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_specifications_are_value_errors(tags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(structural_tag=tags)


def test_a_trigger_holding_an_added_token_is_refused_at_compile(llm):
    tags = {"structures": [{"begin": "<think>x", "schema": {}}], "triggers": ["<think>x"]}
    with pytest.raises(ValueError, match="holds an added token"):
        grammar(llm, tags)


def test_a_qwen3_style_tool_call_passes_and_a_wrong_one_is_corrected(tmp_path):
    """On a scripted model that answers ``H<tool_call>42</tool_call>`` with Qwen3's added tokens, a
    tag whose schema allows 42 leaves the answer as it is; one asking for a string corrects it."""
    path = write_scripted_model(
        tmp_path / "m.gguf", ["H", "<tool_call>", "4", "2", "</tool_call>", "<|im_end|>"]
    )
    llm = ob.LLM(path)
    prompt = llm.tokenizer.encode("x\n", add_special_tokens=False)

    def answer(schema: dict | None) -> str:
        tags = {
            "structures": [{"begin": "<tool_call>", "schema": schema, "end": "</tool_call>"}],
            "triggers": ["<tool_call>"],
        }
        spec = (
            None
            if schema is None
            else StructuredOutputsParams(structural_tag=tags, disable_any_whitespace=True)
        )
        params = ob.SamplingParams(
            max_tokens=12, temperature=0, skip_special_tokens=False, structured_outputs=spec
        )
        return llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].text

    free = answer(None)
    assert free == "H<tool_call>42</tool_call>"
    assert answer({"type": "integer", "minimum": 40, "maximum": 49}) == free
    corrected = answer({"type": "string", "maxLength": 3})
    assert corrected.startswith('H<tool_call>"'), corrected
    if "</tool_call>" in corrected:
        assert isinstance(json.loads(corrected[len("H<tool_call>") : corrected.index("</tool_call>")]), str)

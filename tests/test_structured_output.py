"""Structured output (``SamplingParams.structured_outputs``) end to end on the native runner.

The reference: the generated tokens are recomputed in one forward pass (``LLM.logits``, bit-identical
to the steps), and the request's own seeded Rust sampler is replayed over those rows with the masks
of a fresh copy of its grammar. The engine must give exactly those tokens (greedy or sampled), each
one a token the grammar allowed, and stop once the grammar is complete. Finished outputs are checked
against the specification with plain Python (``json``, ``re``). Batched, chunked, preempted and
cached runs give the same tokens as a lone run; bad specifications fail before anything runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tag": {"enum": ["x", "yy"]}, "ok": {"type": "boolean"}},
    "required": ["n", "tag", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-e]{2,5}@[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
LARK = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'
GBNF = 'root ::= "<" [a-c]+ ">"'

SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_text": StructuredOutputsParams(json=json.dumps(SCHEMA)),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "lark": StructuredOutputsParams(grammar=LARK),
    "gbnf": StructuredOutputsParams(grammar=GBNF),
}


def satisfies(kind: str, text: str) -> bool:
    """Whether a complete output meets its specification, checked without the grammar engine."""
    if kind in ("json", "json_text"):
        value = json.loads(text)
        return (
            set(value) == {"n", "tag", "ok"}
            and type(value["n"]) is int
            and value["tag"] in ("x", "yy")
            and type(value["ok"]) is bool
        )
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "lark":
        return re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", text) is not None
    return re.fullmatch(r"<[a-c]+>", text) is not None


def allows(mask: np.ndarray, token: int) -> bool:
    return bool(int(mask[token // 32]) >> (token % 32) & 1)


def replay(llm: ob.LLM, prompt: list[int], out: ob.CompletionOutput, params: ob.SamplingParams) -> None:
    """Checks ``out`` token by token against the reference described in the module doc."""
    assert params.structured_outputs is not None and params.seed is not None
    grammar = llm._engine._grammars.compile(params.structured_outputs)
    rows = llm.logits(prompt + out.token_ids)[len(prompt) - 1 :]
    sampler = params.sampler(0)
    stops = llm.tokenizer.stop_token_ids
    for i, token in enumerate(out.token_ids):
        assert not grammar.done, f"token {i} came after the grammar was complete"
        mask = grammar.mask()
        want = sampler.sample(rows[i], prompt, out.token_ids[:i], None, None, mask)[0]
        assert token == want, f"token {i}: {token}, the reference samples {want}"
        assert allows(mask, token)
        if token in stops:
            assert i == len(out.token_ids) - 1 and out.finish_reason == "stop"
            return
        grammar.accept([token])
    if out.finish_reason == "stop":
        assert grammar.done, "a stop before the grammar is complete"
    else:
        assert out.finish_reason == "length" and not grammar.done


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> ob.LLM:
    return ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4)


def random_text_prompts(rng: np.random.Generator, n: int) -> list[str]:
    words = ["Hello", "world", "the", "and", "you", "is", "of", "a", "user", "Hi"]
    return [" ".join(rng.choice(words, int(rng.integers(1, 12)))) for _ in range(n)]


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_tokens_are_the_reference_masked_draws_and_complete_outputs_match(llm, rng, kind):
    prompts = random_text_prompts(rng, 3)
    tokenizer = llm.tokenizer
    for temperature in (0.0, float(rng.uniform(0.5, 1.5))):
        params = ob.SamplingParams(
            max_tokens=48,
            temperature=temperature,
            top_p=float(rng.choice([1.0, 0.9])),
            seed=int(rng.integers(0, 2**63)),
            structured_outputs=SPECS[kind],
        )
        for prompt, result in zip(prompts, llm.generate(prompts, params), strict=True):
            out = result.outputs[0]
            replay(llm, tokenizer.encode(prompt), out, params)
            if out.finish_reason == "stop":
                assert satisfies(kind, out.text), out.text


def test_choice_always_completes_with_one_of_the_choices(llm, rng):
    params = ob.SamplingParams(temperature=1.0, max_tokens=20, structured_outputs={"choice": CHOICES})
    for out in llm.generate(random_text_prompts(rng, 8), params):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CHOICES


def test_batched_chunked_preempted_and_cached_runs_equal_lone_runs(tiny_model, rng):
    kinds = [str(k) for k in rng.choice(sorted(SPECS), 6)]
    prompts = [
        [int(t) for t in rng.integers(3, 300, int(n))] for n in rng.integers(20, 90, len(kinds))
    ]  # no stop ids in the prompts
    params = [
        ob.SamplingParams(
            max_tokens=24, temperature=0.8, seed=int(rng.integers(0, 2**63)), structured_outputs=SPECS[k]
        )
        for k in kinds
    ]
    plain = ob.SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    lone = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=1, enable_prefix_caching=False)
    want = [lone.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    blocks = max(-(-(len(p) + 24) // 16) for p in prompts) + 2
    tight = ob.LLM(
        tiny_model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_blocks=blocks
    )
    # Unconstrained requests between the constrained ones share their steps.
    mixed = [x for pair in zip(prompts, prompts, strict=True) for x in pair]
    mixed_params = [x for pair in zip(params, [plain] * len(params), strict=True) for x in pair]
    assert [g.outputs[0].token_ids for g in tight.generate(mixed, mixed_params)[::2]] == want
    assert tight._engine.scheduler_stats()["preemptions"] > 0
    roomy = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4)
    for cached in (False, True):
        got = roomy.generate(mixed, mixed_params)[::2]
        assert [g.outputs[0].token_ids for g in got] == want
        assert all(g.num_cached_tokens > 0 for g in got) == cached
    stats = tight.cache_stats()
    assert stats["free_blocks"] + stats["idle_blocks"] == stats["capacity_blocks"], "no block leaks"


def test_the_grammar_ends_the_request_despite_ignore_eos_min_tokens_and_stop_strings(llm, rng):
    prompt = random_text_prompts(rng, 1)
    for extra in ({"ignore_eos": True}, {"min_tokens": 3}, {"stop": ["zz"]}):
        params = ob.SamplingParams(max_tokens=30, structured_outputs={"choice": ["abc", "de"]}, **extra)
        out = llm.generate(prompt, params)[0].outputs[0]
        assert out.finish_reason == "stop" and out.text in ("abc", "de"), (extra, out)
    # A stop string inside the constrained output still ends it there.
    out = llm.generate(prompt, ob.SamplingParams(structured_outputs={"choice": ["abcd"]}, stop=["c"]))[0]
    assert (out.outputs[0].text, out.outputs[0].stop_reason) == ("ab", "c")


def test_streamed_text_is_the_full_text(llm, rng):
    params = ob.SamplingParams(max_tokens=30, seed=3, structured_outputs=SPECS["lark"])
    prompt = random_text_prompts(rng, 1)[0]
    pieces = list(llm.stream(prompt, params))
    assert pieces[-1].finished
    assert pieces[-1].outputs[0].text == llm.generate([prompt], params)[0].outputs[0].text


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"regex": "(ab"}, "invalid structured output"),
        ({"json": "{not json"}, "not a valid JSON schema"),
        ({"json": {"type": "nonsense"}}, "invalid structured output"),
        ({"grammar": "start: missing_rule"}, "invalid structured output"),
    ],
)
def test_invalid_specifications_fail_before_anything_runs(llm, spec, message):
    before = llm._engine.scheduler_stats()["admitted"]
    good = ob.SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=message):
        llm.generate(["a", "b"], [good, ob.SamplingParams(structured_outputs=spec)])
    assert llm._engine.scheduler_stats()["admitted"] == before
    assert not llm._engine.has_unfinished()


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({}, ValueError, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, ValueError, "got regex, choice"),
        ({"regex": ""}, TypeError, "regex must be a non-empty str"),
        ({"choice": []}, TypeError, "choice must be a non-empty list"),
        ({"choice": ["a", 3]}, TypeError, "choice must hold non-empty strings"),
        ({"json": 3}, TypeError, "json must be a JSON schema"),
        ({"json_object": "yes"}, TypeError, "json_object must be a bool"),
    ],
)
def test_bad_structured_outputs_params_are_refused(fields, error, message):
    with pytest.raises(error, match=message):
        StructuredOutputsParams(**fields)
    with pytest.raises(error, match=message):
        ob.SamplingParams(structured_outputs=fields)


def test_sampling_params_take_a_dict_and_refuse_unknown_fields():
    params = ob.SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    assert not ob.SamplingParams(temperature=0, structured_outputs={"regex": "a"}).is_plain_greedy
    with pytest.raises(TypeError, match="unknown field"):
        ob.SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(TypeError, match="structured_outputs must be"):
        ob.SamplingParams(structured_outputs="a+")


def test_a_grammar_that_allows_only_stop_ids_overrides_min_tokens(llm):
    """Before ``min_tokens`` the stop ids are banned; when the grammar allows nothing else, the ban
    yields (a step that could sample nothing would fail every request in it)."""
    stop = llm.tokenizer.encode("x")
    assert len(stop) == 1
    params = ob.SamplingParams(
        min_tokens=5, max_tokens=8, stop_token_ids=stop, structured_outputs={"regex": "x"}
    )
    other = ob.SamplingParams(max_tokens=8, temperature=0)
    outs = llm.generate(["Hello", "world"], [params, other])
    assert outs[0].outputs[0].token_ids == stop and outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[1].outputs[0].token_ids) > 0

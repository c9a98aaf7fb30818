"""``LLM.beam_search`` (vLLM's): width 1 is greedy decoding; the native runner's forked beams match a
reference that recomputes every beam from its tokens (and leave nothing behind), the engine's
one-token beams a reference over uncached requests (the same bits), each beam's
logprobs are the teacher-forced ones of its tokens, beams come best first by vLLM's length-penalized
score, stop tokens complete a beam (``"stop"``, its text without the token), and bad parameters are
clear errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai.beam_search import EngineBeams, beam_search, top_logprobs

from scripted_model import write_scripted_model


def random_prompts(rng: np.random.Generator, k: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, 800, int(n))] for n in rng.integers(3, 40, k)]


@pytest.mark.parametrize("runner", ["native", "torch"])
def test_width_one_is_greedy(tiny_model, rng, runner):
    if runner == "torch":
        pytest.importorskip("torch")
    llm = ob.LLM(tiny_model) if runner == "native" else ob.LLM(tiny_model, runner="torch", device="cpu")
    prompts = random_prompts(rng, 3)
    beams = llm.beam_search(prompts, ob.BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    greedy = llm.generate(prompts, ob.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out, want in zip(prompts, beams, greedy, strict=True):
        (beam,) = out.sequences
        assert beam.tokens == prompt + want.outputs[0].token_ids and beam.finish_reason == "length"


def engine_reference(llm: ob.LLM, prompt: list[int], width: int, steps: int) -> list[tuple[float, list[int]]]:
    """Textbook beam search (no stop tokens, no length penalty) over the engine's top 2 * width logprobs."""
    beams = [(0.0, list(prompt))]
    one = ob.SamplingParams(max_tokens=1, temperature=0, logprobs=2 * width)
    for _ in range(steps):
        outs = llm.generate([{"prompt_token_ids": b} for _, b in beams], one, use_tqdm=False)
        pool = [
            (cum + entry.logprob, -i, -token, [*tokens, token])
            for i, ((cum, tokens), out) in enumerate(zip(beams, outs, strict=True))
            for token, entry in (out.outputs[0].logprobs or [{}])[0].items()
        ]
        beams = [(cum, tokens) for cum, _, _, tokens in sorted(pool, reverse=True)[:width]]
    return beams


def logits_reference(llm: ob.LLM, prompt: list[int], width: int, steps: int) -> list[tuple[float, list[int]]]:
    """The same over ``top_logprobs`` of each beam's logits computed from scratch (``LLM.logits``)."""
    beams = [(0.0, list(prompt))]
    for _ in range(steps):
        pool = [
            (cum + logprob, -i, -token, [*tokens, token])
            for i, (cum, tokens) in enumerate(beams)
            for token, logprob in top_logprobs(llm.logits(tokens)[-1], 2 * width)
        ]
        beams = [(cum, tokens) for cum, _, _, tokens in sorted(pool, reverse=True)[:width]]
    return beams


def test_forked_beams_match_a_reference_from_scratch(tiny_model, rng):
    """The native runner's beams (forked KV sequences) give exactly what recomputing every beam from
    its tokens gives, and leave no sequence or block behind."""
    llm = ob.LLM(tiny_model)
    prompts = random_prompts(rng, 2)
    width = int(rng.integers(2, 6))
    params = ob.BeamSearchParams(beam_width=width, max_tokens=int(rng.integers(3, 24)), ignore_eos=True,
                                 length_penalty=0.0)  # fmt: skip
    for prompt, out in zip(prompts, llm.beam_search(prompts, params), strict=True):
        want = logits_reference(llm, prompt, width, params.max_tokens)
        assert [(b.cum_logprob, b.tokens) for b in out.sequences] == want
    model = llm._runner._model
    assert model.num_sequences == 0 and model.num_available_blocks == model.num_blocks


def test_engine_beams_match_a_reference_without_the_cache(tiny_model, rng):
    """Beams as one-token engine requests (what the torch runner runs) give what a plain beam search
    over uncached requests gives."""
    llm = ob.LLM(tiny_model)
    uncached = ob.LLM(tiny_model, enable_prefix_caching=False)
    (prompt,) = random_prompts(rng, 1)
    width = int(rng.integers(2, 5))
    params = ob.BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True, length_penalty=0.0)

    def step(prompts: list[dict], one: ob.SamplingParams) -> list[ob.RequestOutput]:
        return llm.generate(prompts, one, use_tqdm=False)

    stop = set(llm.tokenizer.stop_token_ids)
    (out,) = beam_search(lambda: EngineBeams(step, width), [prompt], params, stop, llm.tokenizer.decode)
    assert [(b.cum_logprob, b.tokens) for b in out.sequences] == engine_reference(uncached, prompt, width, 6)


def test_logprobs_are_teacher_forced_and_beams_come_best_first(tiny_model, rng):
    llm = ob.LLM(tiny_model, kernel="reference", kv_cache_dtype="f32")
    (prompt,) = random_prompts(rng, 1)
    penalty = float(rng.uniform(0.5, 2.0))
    params = ob.BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True, length_penalty=penalty)
    (out,) = llm.beam_search([prompt], params)
    assert len(out.sequences) == 4
    scores = [b.cum_logprob / len(b.tokens) ** penalty for b in out.sequences]
    assert scores == sorted(scores, reverse=True)
    for beam in out.sequences:
        logits = llm.logits(beam.tokens[:-1]).astype(np.float64)[len(prompt) - 1 :]
        logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        forced = logits[np.arange(len(logits)), beam.tokens[len(prompt) :]] - logz
        np.testing.assert_allclose(beam.logprobs, forced, atol=1e-4)
        assert math.isclose(beam.cum_logprob, sum(beam.logprobs), abs_tol=1e-5)
        assert beam.text == llm.tokenizer.decode(beam.tokens[len(prompt) :])


def test_a_stop_token_completes_a_beam(tmp_path):
    """On a scripted model the best beam is the script, complete at its stop token; the others go on to
    the length limit or stop later, each with its text without the stop token."""
    llm = ob.LLM(write_scripted_model(tmp_path / "m.gguf", ["alpha", "beta", "<|im_end|>"]))
    prompt = llm.tokenizer.encode("x\n", add_special_tokens=False)
    out = llm.beam_search([prompt], ob.BeamSearchParams(beam_width=3, max_tokens=6))[0]
    best = out.sequences[0]
    assert best.finish_reason == "stop" and best.text == "alphabeta"
    assert best.tokens[-1] in llm.tokenizer.stop_token_ids and len(best.tokens) == len(prompt) + 3
    for beam in out.sequences:
        ended = beam.tokens[-1] in llm.tokenizer.stop_token_ids
        assert beam.finish_reason == ("stop" if ended else "length")
        generated = beam.tokens[len(prompt) : len(beam.tokens) - (1 if ended else 0)]
        assert beam.text == llm.tokenizer.decode(generated)


def test_bad_parameters_are_clear_errors(tiny_model):
    with pytest.raises(ValueError, match="beam_width must be >= 1"):
        ob.BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width must be <= 10"):
        ob.BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        ob.BeamSearchParams(beam_width=2, max_tokens=4.0)  # type: ignore[arg-type]
    llm = ob.LLM(tiny_model, max_model_len=64)
    with pytest.raises(ValueError, match="exceed the context"):
        llm.beam_search([[1] * 60], ob.BeamSearchParams(beam_width=2, max_tokens=8))


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_a_forked_sequence_steps_as_its_tokens_from_scratch(tiny_model, rng, dtype):
    """``Model.fork_sequence`` on every KV dtype (int8's scales copied too): the fork and its parent,
    stepped on with different tokens, give the logits of their whole token lists computed afresh."""
    llm = ob.LLM(tiny_model, kv_cache_dtype=dtype)
    model = llm._runner._model
    (prompt,) = random_prompts(rng, 1)
    seq, cached = model.add_sequence_cached(prompt)
    model.step([(seq, prompt[cached:], "last")])
    fork = model.fork_sequence(seq)
    a, b = [int(t) for t in rng.integers(0, 800, 2)]
    rows = model.step([(seq, [a], "last"), (fork, [b], "last")])
    np.testing.assert_array_equal(rows[0], llm.logits([*prompt, a])[-1])
    np.testing.assert_array_equal(rows[1], llm.logits([*prompt, b])[-1])
    model.free_sequence(seq)
    model.free_sequence(fork)
    assert model.num_available_blocks == model.num_blocks


@pytest.mark.parametrize("runner", ["native", "torch"])
def test_a_salted_prompt_gets_the_same_beams_from_its_own_cache(tiny_model, rng, runner):
    """A prompt dict's ``cache_salt`` reaches the beams' sequences (native) or one-token requests
    (torch): the beams are those of the unsalted prompt, and its blocks are cached apart."""
    if runner == "torch":
        pytest.importorskip("torch")
    args = {} if runner == "native" else {"runner": "torch", "device": "cpu"}
    llm = ob.LLM(tiny_model, **args)
    prompt = [int(t) for t in rng.integers(0, 800, 40)]
    params = ob.BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    plain = llm.beam_search([prompt], params)[0]
    salted = llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], params)[0]
    assert [(b.tokens, b.cum_logprob) for b in salted.sequences] == [
        (b.tokens, b.cum_logprob) for b in plain.sequences
    ]
    one = ob.SamplingParams(max_tokens=1, temperature=0)
    again = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], one)[0]
    assert again.num_cached_tokens >= 32  # the salted search's full blocks
    other = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], one)[0]
    assert other.num_cached_tokens == 0

"""The generate / chat / stream API on a tiny random model: sampling parameters, seeds, stop
conditions, outputs and metrics."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import oxibonsai as ob

GREEDY = ob.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> ob.LLM:
    return ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4)


def words(rng: np.random.Generator, n: int = 6) -> str:
    pool = ["the", "model", "returns", "a", "value", "of", "list", "string", "file", "open", "read"]
    return " ".join(rng.choice(pool, n))


def tokens(out: ob.RequestOutput) -> list[int]:
    return out.outputs[0].token_ids


def test_outputs_are_shaped_like_vllm(llm, rng):
    prompt = words(rng)
    out = llm.generate(prompt, GREEDY)[0]
    assert out.prompt == prompt and out.prompt_token_ids == llm.tokenizer.encode(prompt)
    c = out.outputs[0]
    assert out.finished and c.index == 0 and c.finish_reason == "length" and len(c.token_ids) == 10
    assert c.text == llm.tokenizer.decode(c.token_ids)
    m = out.metrics
    assert m.time_to_first_token > 0 and m.num_prompt_tokens == len(out.prompt_token_ids)
    assert m.num_generated_tokens == 10 and m.decode_tokens_per_s > 0 and m.prefill_tokens_per_s > 0


def test_prompt_forms_are_equivalent(llm, rng):
    text = words(rng)
    ids = llm.tokenizer.encode(text)
    a, b, c, d = llm.generate([text, ids, {"prompt": text}, {"prompt_token_ids": ids}], GREEDY)
    assert tokens(a) == tokens(b) == tokens(c) == tokens(d)


def test_temperature_zero_and_top_k_one_are_greedy(llm, rng):
    prompt = words(rng)
    greedy = tokens(llm.generate(prompt, GREEDY)[0])
    top1 = ob.SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True, seed=7)
    assert tokens(llm.generate(prompt, top1)[0]) == greedy


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm, rng):
    prompt = words(rng)
    seed = int(rng.integers(0, 2**63))
    params = ob.SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
    alone = tokens(llm.generate(prompt, params)[0])
    others = ob.SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    batch = llm.generate([words(rng), prompt, words(rng)], [others, params, others])
    assert tokens(batch[1]) == alone
    assert tokens(llm.generate(prompt, params)[0]) == alone


def test_n_samples_are_the_seeded_requests_and_share_the_prompt(llm, rng):
    prompt = llm.tokenizer.encode(words(rng, 60))
    seed = int(rng.integers(0, 2**63))
    params = ob.SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
    hits = llm.cache_stats()["hit_tokens"]
    other = words(rng)
    out = llm.generate([prompt, other], [params, GREEDY])
    shared = llm.cache_stats()["hit_tokens"] - hits
    assert [c.index for c in out[0].outputs] == [0, 1, 2] and len(out[1].outputs) == 1
    assert shared >= 2 * ((len(prompt) - 1) // llm.block_size * llm.block_size), "samples 1 and 2 hit"
    for i, completion in enumerate(out[0].outputs):
        alone = ob.SamplingParams(max_tokens=8, temperature=1.0, seed=seed + i, ignore_eos=True)
        assert completion.token_ids == tokens(llm.generate([prompt], alone)[0])
    assert tokens(out[1]) == tokens(llm.generate(other, GREEDY)[0])
    with pytest.raises(ValueError, match="a request generates one sample, got n=2"):
        next(llm.stream(other, ob.SamplingParams(n=2)))


def test_unseeded_requests_follow_the_llm_seed(tiny_model, rng):
    prompt = words(rng)
    params = ob.SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    runs = [tokens(ob.LLM(tiny_model, seed=s).generate(prompt, params)[0]) for s in (3, 3, 4)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_max_tokens_min_tokens_and_stop_token_ids(llm, rng):
    prompt = words(rng)
    greedy = tokens(llm.generate(prompt, GREEDY)[0])
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    params = ob.SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at and c.token_ids == greedy[: first + 1]
    assert c.text == llm.tokenizer.decode(greedy[:first])
    banned = ob.SamplingParams(
        max_tokens=10, min_tokens=8, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True
    )
    assert stop_at not in tokens(llm.generate(prompt, banned)[0])[:8]


def test_stop_strings_never_leak_into_text_or_stream(llm, rng):
    prompt = words(rng)
    text = llm.generate(prompt, ob.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    full = text.outputs[0].text
    if len(full) < 4:
        pytest.skip("the random model produced too little text to cut")
    cut = int(rng.integers(1, len(full) - 2))
    stop = full[cut : cut + 2]
    params = ob.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.find(stop)]
    streamed = [o.outputs[0].text for o in llm.stream(prompt, params)]
    assert all(stop not in t for t in streamed) and streamed[-1] == out.text
    assert all(b.startswith(a) for a, b in itertools.pairwise(streamed))


def test_stream_ends_with_the_generate_result(llm, rng):
    prompt = words(rng)
    outs = list(llm.stream(prompt, GREEDY))
    assert len(outs) == 10 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert tokens(outs[-1]) == tokens(llm.generate(prompt, GREEDY)[0])


def test_repetition_penalty_reaches_the_sampler(llm, rng):
    # A heavy penalty divides every seen token's (positive) logit by 100: with ~800 tokens of logit
    # std ~4, an unseen token always wins, so greedy output never repeats the prompt or itself.
    prompt = llm.tokenizer.encode(words(rng))
    params = ob.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=100.0)
    out = tokens(llm.generate([prompt], params)[0])
    assert len(set(out)) == len(out) and not set(out) & set(prompt)


def test_logit_bias_steers_generation_and_is_checked_against_the_vocabulary(llm, rng):
    prompt = llm.tokenizer.encode(words(rng))
    greedy = ob.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = tokens(llm.generate([prompt], greedy)[0])
    forced = int(rng.integers(llm.tokenizer.vocab_size))
    biased = ob.SamplingParams(**{**vars(greedy), "logit_bias": {forced: 100.0}})
    assert tokens(llm.generate([prompt], biased)[0]) == [forced] * 6
    banned = ob.SamplingParams(**{**vars(greedy), "logit_bias": {plain[0]: -100.0}})
    assert tokens(llm.generate([prompt], banned)[0])[0] != plain[0]
    vocab = llm.tokenizer.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is out of range"):
        llm.generate([prompt], ob.SamplingParams(logit_bias={vocab: 1.0}))


def test_logprobs_are_sorted_raw_log_softmax(llm, rng):
    prompt = llm.tokenizer.encode(words(rng))
    out = llm.generate([prompt], ob.SamplingParams(max_tokens=3, temperature=0.0, logprobs=4))[0].outputs[0]
    full = llm.logits(prompt + out.token_ids).astype(np.float64)
    for i, entry in enumerate(out.logprobs or []):
        row = full[len(prompt) - 1 + i]
        logz = np.log(np.exp(row - row.max()).sum()) + row.max()
        best = sorted(entry.items(), key=lambda kv: kv[1].rank or 99)[:4]
        assert [t for t, _ in best] == [int(t) for t in np.argsort(-row, kind="stable")[:4]]
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t] - logz, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(out.logprobs or [], out.token_ids, strict=True))
    )


def test_chat_applies_the_template(llm, rng):
    messages = [{"role": "user", "content": words(rng)}]
    out = llm.chat(messages, GREEDY)[0]
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert tokens(out) == tokens(llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY)[0])
    two = llm.chat([messages, messages], GREEDY)
    assert tokens(two[0]) == tokens(two[1]) == tokens(out)

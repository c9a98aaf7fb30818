"""``SamplingParams(prompt_logprobs=k)`` end to end on the native runner: every prompt token after the
first gets its raw logprob, rank and top ``k`` logprobs, equal to a float64 ``log_softmax`` of the
logits after every position (``LLM.logits``); the generated tokens do not change; a cached prefix
is computed anyway (its logits are needed); chunked, batched and preempted prefills give the same
scores as a lone run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import oxibonsai as ob


def random_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def expected(llm: ob.LLM, ids: list[int], k: int) -> list[tuple[float, int, list[int]]]:
    """Per position 1..: the token's float64 logprob, its rank and the top-k ids (ties to the lower id)."""
    logits = llm.logits(ids).astype(np.float64)
    rows = []
    for pos in range(1, len(ids)):
        row = logits[pos - 1]
        lse = row.max() + np.log(np.exp(row - row.max()).sum())
        token = ids[pos]
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        rows.append((row[token] - lse, int((row > row[token]).sum()) + 1, order))
    return rows


def check_scores(out: ob.RequestOutput, want: list[tuple[float, int, list[int]]], k: int) -> None:
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(out.prompt_token_ids) and got[0] is None
    for pos, (entry, (logprob, rank, top)) in enumerate(zip(got[1:], want, strict=True), 1):
        assert entry is not None
        token = out.prompt_token_ids[pos]
        assert entry[token].logprob == pytest.approx(logprob, abs=2e-5)
        assert list(entry)[:k] == top, "the top k first, in rank order"
        if token not in top:
            assert entry[token].rank == rank and len(entry) == k + 1
        assert all(lp.decoded_token is not None for lp in entry.values())


def assert_same_scores(got: ob.RequestOutput, want: ob.RequestOutput, tol: float) -> None:
    """The same tokens, and the same prompt logprobs (ranks exactly, logprobs within ``tol``)."""
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None and a.keys() == b.keys()
        for t in a:
            assert a[t].rank == b[t].rank and a[t].logprob == pytest.approx(b[t].logprob, abs=tol)


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> ob.LLM:
    return ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4)


def test_prompt_logprobs_match_a_float64_softmax_and_change_no_token(llm, rng):
    vocab = llm.config["vocab"]
    k = int(rng.integers(0, 5))
    prompts = [random_ids(rng, vocab, int(n)) for n in rng.integers(2, 60, 3)]
    plain = ob.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    scored = ob.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
    outs = llm.generate(prompts, scored)
    for ids, out, alone in zip(prompts, outs, llm.generate(prompts, plain), strict=True):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert alone.prompt_logprobs is None
        check_scores(out, expected(llm, ids, k), k)


def test_a_cached_prefix_is_computed_again_and_scored_the_same(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=2)
    ids = random_ids(rng, llm.config["vocab"], int(rng.integers(40, 90)))
    params = ob.SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    cold = llm.generate([ids], params)[0]
    assert llm.generate([ids], ob.SamplingParams(max_tokens=2))[0].num_cached_tokens > 0
    warm = llm.generate([ids], params)[0]
    assert warm.num_cached_tokens == 0, "a scored prompt never starts on cached blocks"
    assert warm.prompt_logprobs == cold.prompt_logprobs
    check_scores(warm, expected(llm, ids, 1), 1)


def test_chunked_batched_and_preempted_prefills_score_as_a_lone_run(tiny_model, rng):
    vocab = 300
    prompts = [random_ids(rng, vocab, int(n)) for n in rng.integers(40, 120, 6)]
    params = ob.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    lone = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=1, enable_prefix_caching=False)
    want = [lone.generate([p], params)[0] for p in prompts]
    # 32-token chunks, four requests at once, and a pool too small for all of them: preemptions.
    blocks = max(-(-(len(p) + 8) // 16) for p in prompts) + 2
    tight = ob.LLM(
        tiny_model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_blocks=blocks
    )
    got = tight.generate(prompts, params)
    assert tight._engine.scheduler_stats()["preemptions"] > 0
    for g, w in zip(got, want, strict=True):
        assert_same_scores(g, w, 1e-5)
    stats = tight.cache_stats()
    assert stats["free_blocks"] + stats["idle_blocks"] == stats["capacity_blocks"], "no block leaks"


def test_streams_n_samples_and_one_token_prompts(llm, rng):
    vocab = llm.config["vocab"]
    ids = random_ids(rng, vocab, 20)
    first = next(iter(llm.stream(ids, ob.SamplingParams(max_tokens=3, prompt_logprobs=0))))
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 20
    merged = llm.generate([ids], ob.SamplingParams(n=2, max_tokens=2, seed=5, prompt_logprobs=1))[0]
    assert len(merged.outputs) == 2 and merged.prompt_logprobs is not None
    one = llm.generate([[int(rng.integers(0, vocab))]], ob.SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    assert one.prompt_logprobs == [None]


@pytest.mark.parametrize(
    ("bad", "error"), [(-1, ValueError), (21, ValueError), (1.5, TypeError), ("2", TypeError)]
)
def test_bad_prompt_logprobs_are_refused(bad, error):
    with pytest.raises(error, match="prompt_logprobs"):
        ob.SamplingParams(prompt_logprobs=bad)

"""Speculative decoding with n-gram drafts: the same tokens, text, logprobs and finish reasons as
decoding one token at a time (greedy, seeded sampling with penalties, stops, grammars, logits
processors, batches under a tiny cache), drafts that really run and are counted, configs refused
clearly, and a scheduler ledger whose invariants hold under random drafted workloads."""

from __future__ import annotations

import secrets
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oxibonsai as ob
from oxibonsai import _core
from oxibonsai.structured_output import StructuredOutputsParams

# Not adaptive: every match drafts, so the identity checks see as many drafts as possible.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "adaptive": False,
}
WORDS = ["the", "file", "open", "returns", "a", "list", "of", "value", "module", "string", "(", ")", "."]


@pytest.fixture(scope="module")
def pair() -> tuple[ob.LLM, ob.LLM]:
    """The embedded default model without and with drafts (a trained model repeats what it saw)."""
    return ob.LLM(max_num_seqs=4), ob.LLM(max_num_seqs=4, speculative_config=NGRAM)


def repetitive(rng: np.random.Generator) -> str:
    """A phrase said three times and begun a fourth: its continuation is in the prompt."""
    phrase = " ".join(rng.choice(WORDS, int(rng.integers(3, 7))))
    return f"{phrase}\n{phrase}\n{phrase}\n" + phrase.split()[0]


def prompts(rng: np.random.Generator, n: int = 4) -> list[str]:
    return [repetitive(rng) if i % 2 == 0 else " ".join(rng.choice(WORDS, 8)) for i in range(n)]


def assert_same(plain: list[ob.RequestOutput], drafted: list[ob.RequestOutput]) -> None:
    for a, b in zip(plain, drafted, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert y.token_ids == x.token_ids, a.prompt
        assert (y.text, y.finish_reason, y.stop_reason) == (x.text, x.finish_reason, x.stop_reason)
        assert y.logprobs == x.logprobs and y.cumulative_logprob == x.cumulative_logprob


def accepted(llm: ob.LLM) -> tuple[int, int]:
    counters = llm.metrics()["counters"]
    return counters["spec_decode_num_draft_tokens_total"], counters["spec_decode_num_accepted_tokens_total"]


def test_greedy_tokens_are_those_of_one_token_at_a_time(pair, rng):
    plain, drafted = pair
    before = accepted(drafted)
    params = ob.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    batch = prompts(rng, 6)
    assert_same(plain.generate(batch, params), drafted.generate(batch, params))
    proposed, kept = (now - then for now, then in zip(accepted(drafted), before, strict=True))
    assert proposed > 0 and 0 < kept <= proposed, "drafts ran and some were kept"
    steps = drafted.metrics()["counters"]
    assert steps["spec_decode_num_drafts_total"] > 0


def test_adaptive_drafting_drafts_for_a_lone_repeating_request_and_keeps_its_tokens(pair, rng):
    plain, _ = pair
    adaptive = ob.LLM(speculative_config={**NGRAM, "adaptive": True, "num_speculative_tokens": 6})
    params = ob.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for prompt in [repetitive(rng) for _ in range(3)]:
        assert_same(plain.generate(prompt, params), adaptive.generate(prompt, params))
    proposed, kept = accepted(adaptive)
    assert proposed > 0 and kept > 0


def test_seeded_sampling_with_penalties_and_logprobs_is_unchanged(pair, rng):
    plain, drafted = pair
    params = [
        ob.SamplingParams(
            max_tokens=32,
            temperature=float(rng.uniform(0.3, 1.2)),
            top_k=int(rng.integers(5, 50)),
            top_p=0.9,
            min_p=0.02,
            repetition_penalty=1.1,
            presence_penalty=0.2,
            frequency_penalty=0.1,
            logprobs=2,
            seed=int(rng.integers(0, 2**63)),
            ignore_eos=True,
        )
        for _ in range(4)
    ]
    batch = prompts(rng)
    assert_same(plain.generate(batch, params), drafted.generate(batch, params))


def test_stop_strings_stop_tokens_and_lengths_end_requests_where_they_would(pair, rng):
    plain, drafted = pair
    batch = prompts(rng)
    word = str(rng.choice(WORDS[:10]))
    stop_id = plain.tokenizer.encode(" " + word)[-1]
    params = [
        ob.SamplingParams(max_tokens=30, temperature=0.0, stop=[word], ignore_eos=True),
        ob.SamplingParams(max_tokens=30, temperature=0.0, stop=[word], include_stop_str_in_output=True),
        ob.SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id], min_tokens=3),
        ob.SamplingParams(max_tokens=int(rng.integers(1, 6)), temperature=0.0, ignore_eos=True),
    ]
    assert_same(plain.generate(batch, params), drafted.generate(batch, params))


def test_grammars_and_logits_processors_see_every_token_in_order(pair, rng):
    plain, _ = pair
    banned = int(plain.tokenizer.encode(" the")[-1])
    seen: dict[int, list[int]] = {0: [], 1: []}

    def recorder(which: int):
        def ban(output_ids: list[int], logits: np.ndarray) -> np.ndarray:
            seen[which].append(len(output_ids))
            logits[banned] = -np.inf
            return logits

        return ban

    batch = prompts(rng, 2)
    regex = StructuredOutputsParams(regex=r"( (the|file|open|list|of|a)){3,12}\.")
    outs = []
    for which, llm in enumerate(pair):
        params = [
            ob.SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=regex),
            ob.SamplingParams(
                max_tokens=24, temperature=0.0, ignore_eos=True, logits_processors=[recorder(which)]
            ),
        ]
        outs.append(llm.generate(batch, params))
    assert_same(*outs)
    assert seen[1] == seen[0] == list(range(24)), "the processor ran once per token, in order"
    assert banned not in outs[1][1].outputs[0].token_ids


def test_a_tiny_cache_preempts_and_every_block_comes_back(tiny_model: Path, rng):
    params = ob.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    batch = [repetitive(rng) for _ in range(6)]
    alone = ob.LLM(tiny_model, max_model_len=128)
    expected = [alone.generate(p, params)[0] for p in batch]
    small = ob.LLM(
        tiny_model,
        max_model_len=128,
        max_num_seqs=4,
        kv_cache_blocks=9,
        max_num_batched_tokens=12,
        speculative_config={**NGRAM, "num_speculative_tokens": 7},
    )
    assert_same(expected, small.generate(batch, params))
    stats = small.cache_stats()
    assert stats["free_blocks"] + stats["idle_blocks"] == stats["capacity_blocks"]
    assert small._engine.scheduler_stats()["preemptions"] > 0, "the cache was small enough to preempt"


def test_streaming_and_aborting_a_drafted_request(pair, rng):
    plain, drafted = pair
    prompt = repetitive(rng)
    params = ob.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    streamed = list(drafted.stream(prompt, params))
    assert streamed[-1].outputs[0].token_ids == plain.generate(prompt, params)[0].outputs[0].token_ids
    lengths = [len(o.outputs[0].token_ids) for o in streamed]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 30
    stream = drafted.stream(prompt, params)
    next(stream)
    stream.close()  # aborted mid-way
    stats = drafted.cache_stats()
    assert stats["free_blocks"] + stats["idle_blocks"] == stats["capacity_blocks"]


def test_configs_are_checked_before_any_work(tiny_model):
    bad = [
        {"method": "draft_model", "num_speculative_tokens": 3},
        {"method": "ngram"},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "ngram", "num_speculative_tokens": 65},
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        {"method": "ngram", "num_speculative_tokens": 3, "model": "draft.gguf"},
        {"method": "ngram", "num_speculative_tokens": 3, "adaptive": "yes"},
        "{not json",
        ["ngram"],
    ]
    for config in bad:
        with pytest.raises(ValueError):
            ob.LLM(tiny_model, speculative_config=config)
    parsed = ob.SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5}')
    assert parsed is not None and parsed.core() == (5, 2, 4, True)
    assert ob.SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=1).core() == (2, 1, 1, True)
    assert ob.SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=6, adaptive=False).core() == (
        2,
        6,
        6,
        False,
    )


def test_the_torch_runner_refuses_drafts(tiny_model):
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="native runner"):
        ob.LLM(tiny_model, runner="torch", device="cpu", speculative_config=NGRAM)


def test_metrics_count_drafts_by_position(pair, rng):
    _, drafted = pair
    drafted.generate(repetitive(rng), ob.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    counters = drafted.metrics()["counters"]
    per_pos = counters["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos.values()) == counters["spec_decode_num_accepted_tokens_total"]
    assert all(per_pos[p] >= per_pos[p + 1] for p in per_pos if p + 1 in per_pos), (
        "a draft follows the one before"
    )
    text = drafted.metrics_text()
    assert "oxibonsai_spec_decode_num_draft_tokens_total" in text
    assert 'oxibonsai_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text


# -- the scheduler's ledger under random drafted workloads -----------------------------------------

workloads = st.lists(
    st.tuples(
        st.integers(1, 5),  # pattern length
        st.integers(1, 60),  # prompt length
        st.integers(0, 40),  # room to generate
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=60, deadline=None)
@given(
    workload=workloads,
    blocks=st.integers(8, 40),
    budget=st.integers(8, 64),
    seqs=st.integers(1, 4),
    k=st.integers(1, 8),
    caching=st.booleans(),
    adaptive=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_drafted_ledgers_keep_their_invariants_and_free_every_block(
    workload, blocks, budget, seqs, k, caching, adaptive, seed
):
    rng = np.random.default_rng(seed)
    sched = _core.Scheduler(
        blocks,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(budget, seqs),
        enable_prefix_caching=caching,
        speculation=(k, 1, 3, adaptive),
    )
    limits = {}
    for i, (period, length, room) in enumerate(workload):
        pattern = rng.integers(0, 4, period)
        prompt = [int(t) for t in np.resize(pattern, length)]
        limit = min(length + 1 + room, blocks * 16)
        if limit <= length:
            continue
        sched.add(i, prompt, draft_limit=limit)
        limits[i] = limit
    while sched.num_running + sched.num_waiting:
        out = sched.schedule()
        sched.execute(out)
        drafts = sched.drafts(out)
        kept = [int(rng.integers(0, len(d) + 1)) for d in drafts]
        sampled = [t for d, a in zip(drafts, kept, strict=True) for t in [*d[:a], int(rng.integers(0, 4))]]
        sched.update(out, sampled, kept)
        sched.check()
        for request, _, sample in out.items:
            state = sched.request_state(request)
            if sample and state is not None and (len(state[0]) >= limits[request] or rng.random() < 0.1):
                (sched.finish if rng.random() < 0.5 else sched.abort)(request)
        sched.check()
    assert sched.num_available_blocks == blocks


def test_a_ledger_refuses_a_drafted_step_recorded_without_its_counts():
    sched = _core.Scheduler(16, speculation=(3, 1, 2, False), max_num_seqs=1)
    sched.add(secrets.randbits(32), [4, 5] * 6, draft_limit=64)
    out = sched.schedule()
    sched.execute(out)
    sched.update(out, [4])
    out = sched.schedule()
    sched.execute(out)
    assert sched.drafts(out) == [[5, 4, 5]]
    with pytest.raises(ValueError, match="update_drafted"):
        sched.update(out, [5])
    with pytest.raises(ValueError, match="not its drafts"):
        sched.update(out, [4, 4, 1], [2])
    sched.update(out, [5, 4, 1], [2])
    sched.check()

"""Continuous batching end to end on tiny random models: greedy outputs of many concurrent requests
equal each request run alone, token for token, with chunked prefill forced small, with preemption
forced by a tiny KV pool, and with aborts in the middle; priorities order admission; a full queue
raises ``QueueFull``; invalid requests never enter the queue; every block is free at the end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import oxibonsai as ob

GREEDY = ob.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def random_prompts(rng: np.random.Generator, n: int, low: int = 1, high: int = 90) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, 300, int(rng.integers(low, high)))] for _ in range(n)]


def token_lists(outs: list[ob.RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(tiny_model: Path) -> ob.LLM:
    """One request at a time, no cache: the reference every batched run must match."""
    return ob.LLM(tiny_model, max_model_len=256, max_num_seqs=1, enable_prefix_caching=False)


def reference(alone: ob.LLM, prompts: list[list[int]], params: ob.SamplingParams) -> list[list[int]]:
    return [token_lists(alone.generate(p, params))[0] for p in prompts]


def assert_all_blocks_free(llm: ob.LLM) -> None:
    assert not llm._engine.has_unfinished() and llm._engine.num_waiting == llm._engine.num_running == 0
    llm.reset_prefix_cache()
    stats = llm.cache_stats()
    assert stats["free_blocks"] == stats["capacity_blocks"]


@pytest.mark.parametrize(
    ("seqs", "batched_tokens", "caching"),
    [(16, 256, False), (4, 8, False), (8, 8, True), (3, 5, True)],
    ids=["wide", "chunks-of-8", "chunks-of-8-cached", "chunks-of-5-cached"],
)
def test_concurrent_greedy_outputs_equal_each_request_alone(
    tiny_model, alone, rng, seqs, batched_tokens, caching
):
    prompts = random_prompts(rng, 12)
    llm = ob.LLM(
        tiny_model,
        max_model_len=256,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched_tokens,
        enable_prefix_caching=caching,
    )
    assert token_lists(llm.generate(prompts, GREEDY)) == reference(alone, prompts, GREEDY)
    stats = llm._engine.scheduler_stats()
    assert stats["steps"] >= sum(len(p) for p in prompts) // batched_tokens
    assert_all_blocks_free(llm)


def test_a_tiny_pool_preempts_and_changes_nothing(tiny_model, alone, rng):
    params = ob.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(rng, 8, 10, 40)
    blocks = max(-(-(len(p) + 24) // 16) for p in prompts) + 2  # one long request fits, not four
    llm = ob.LLM(tiny_model, max_model_len=256, kv_cache_blocks=blocks, max_num_seqs=4)
    assert token_lists(llm.generate(prompts, params)) == reference(alone, prompts, params)
    assert llm._engine.scheduler_stats()["preemptions"] > 0
    assert_all_blocks_free(llm)


def test_seeded_sampling_survives_preemption(tiny_model, rng):
    params = ob.SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=int(rng.integers(1 << 30)))
    prompts = random_prompts(rng, 6, 10, 40)
    roomy = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=6)
    tiny = ob.LLM(tiny_model, max_model_len=256, kv_cache_blocks=6, max_num_seqs=6)
    assert token_lists(tiny.generate(prompts, params)) == token_lists(roomy.generate(prompts, params))
    assert tiny._engine.scheduler_stats()["preemptions"] > 0


def test_aborts_in_the_middle_leave_the_others_unchanged(tiny_model, alone, rng):
    prompts = random_prompts(rng, 10)
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16)
    engine = llm._engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, p, GREEDY)
    doomed = {str(i) for i in rng.choice(10, 4, replace=False)}
    outs: dict[str, ob.RequestOutput] = {}
    step = 0
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
        step += 1
        for rid in list(doomed):
            if step >= int(rid) and engine.abort(rid):  # some waiting, some running, some finished
                doomed.discard(rid)
    kept = [i for i in range(10) if str(i) in outs]
    assert len(kept) >= 6
    want = reference(alone, [prompts[i] for i in kept], GREEDY)
    assert [outs[str(i)].outputs[0].token_ids for i in kept] == want
    assert engine.abort("no-such-request") is False
    assert_all_blocks_free(llm)


def test_a_better_priority_is_admitted_first(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=1)
    prompts = random_prompts(rng, 5)
    outs = llm.generate(prompts, GREEDY, priority=[3, 3, 0, 3, -1])
    order = sorted(range(5), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [4, 2, 0, 1, 3]


def test_a_low_priority_request_finishes_under_a_steady_high_priority_stream(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=1, priority_aging_steps=4)
    engine = llm._engine
    short = ob.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("low", None, random_prompts(rng, 1)[0], short, priority=5)
    done: list[str] = []
    for i in range(200):
        # Two high-priority arrivals per step: they alone would keep the only slot busy forever.
        for j in range(2):
            engine.add_request(f"high{i}.{j}", None, random_prompts(rng, 1, 1, 8)[0], short, priority=0)
        done += [o.request_id for o in engine.step() if o.finished]
        if "low" in done:
            break
    assert "low" in done
    # Aging gives it one level per 4 steps: only the high-priority requests that arrived in its first
    # 5 x 4 steps (2 per step) go before it, not the whole stream.
    assert done.index("low") <= 2 * 5 * 4
    engine.abort_all()


def test_a_full_waiting_queue_raises_queue_full_and_changes_nothing(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=1, max_waiting=2)
    engine = llm._engine
    for i in range(2):
        engine.add_request(str(i), None, random_prompts(rng, 1)[0], GREEDY)
    with pytest.raises(ob.QueueFull):
        engine.add_request("late", None, random_prompts(rng, 1)[0], GREEDY)
    assert engine.num_waiting == 2 and not engine.abort("late")
    engine.step()  # one is admitted: there is room again
    engine.add_request("late", None, random_prompts(rng, 1)[0], GREEDY)
    engine.abort_all()
    assert_all_blocks_free(llm)


def test_generate_feeds_a_bounded_queue_and_answers_every_prompt(tiny_model, alone, rng, capsys):
    prompts = random_prompts(rng, 20)
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=2, max_waiting=1)
    outs = llm.generate(prompts, GREEDY, use_tqdm=True)
    assert token_lists(outs) == reference(alone, prompts, GREEDY)
    assert "Processed prompts: 100% 20/20" in capsys.readouterr().err


def test_invalid_requests_never_enter_the_queue(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=64, max_num_seqs=2)
    good = random_prompts(rng, 3, 1, 20)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([*good, list(range(64))], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([*good, [10**6]], GREEDY)
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(good, GREEDY, priority=[0])
    with pytest.raises(ValueError):
        ob.SamplingParams(temperature=-1)
    assert llm.cache_stats()["computed_tokens"] == 0
    assert llm._engine.num_waiting == 0 and not llm._engine.has_unfinished()


def test_engine_arguments_are_validated(tiny_model):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ob.LLM(tiny_model, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="chunked prefill"):
        ob.LLM(tiny_model, max_model_len=256, enable_chunked_prefill=False, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="policy"):
        ob.LLM(tiny_model, max_model_len=256, scheduling_policy="random")
    with pytest.raises(ValueError, match="max_waiting"):
        ob.LLM(tiny_model, max_model_len=256, max_waiting=-1)


def test_longest_prefix_policy_gives_the_same_tokens(tiny_model, alone, rng):
    prefix = random_prompts(rng, 1, 40, 41)[0]
    prompts = [prefix + p if i % 2 else p for i, p in enumerate(random_prompts(rng, 8, 1, 20))]
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=2, scheduling_policy="longest_prefix")
    assert token_lists(llm.generate(prompts, GREEDY)) == reference(alone, prompts, GREEDY)
    assert llm.cache_stats()["hits"] > 0


def test_engine_metrics_count_what_ran(tiny_model, rng):
    params = ob.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(rng, 6, 10, 40)
    llm = ob.LLM(tiny_model, max_model_len=256, kv_cache_blocks=8, max_num_seqs=4)
    outs = llm.generate(prompts, params)
    m = llm.metrics()
    sched = m["scheduler"]
    assert m["counters"]["requests_finished"]["length"] == 6
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert m["counters"]["generation_tokens_total"] == generated == 6 * 24
    assert m["counters"]["preemptions_total"] == sched["preemptions"] > 0
    # Every scheduled token is a prompt token (recomputation after preemption included) or a decode.
    assert m["counters"]["prompt_tokens_total"] + sched["decode_tokens"] == sched["scheduled_tokens"]
    assert m["histograms"]["time_to_first_token_seconds"]["count"] == 6
    assert m["gauges"]["num_requests_running"] == m["gauges"]["num_requests_waiting"] == 0
    assert 'oxibonsai_requests_finished_total{finished_reason="length"} 6' in llm.metrics_text()

"""The engine's overlap of a step's output work with the next step (``Runner.async_output``), forced on
over the native runner, whose launch runs the step at once: every request's outputs (streamed
snapshots included: text, tokens, finish and stop reasons, logprobs) and the scheduler's counters equal
those of the plain order, for mixes of greedy, seeded, stop-string, stop-token, ``min_tokens`` and
logprob requests; a request aborted while its step runs gets no further output and leaks no block; a
failed launch is raised by the next call, after the outputs of the step before it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from request_mix import mixed_requests, summary

import oxibonsai as ob


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> ob.LLM:
    return ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24)


def run(llm: ob.LLM, requests: list[tuple[list[int], ob.SamplingParams]], overlap: bool) -> tuple[Any, Any]:
    """Every streamed output of each request, and the scheduler's counters added up over the run."""
    engine = llm._engine
    engine._runner.async_output = overlap
    before = engine.scheduler_stats()
    tag = "overlap" if overlap else "plain"
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", None, prompt, params, stream=True)
    seen: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            seen[int(out.request_id.split("-")[1])].append(summary(out))
    after = engine.scheduler_stats()
    engine._runner.async_output = False
    return dict(seen), {key: after[key] - before[key] for key in after}


def test_overlapped_output_work_changes_no_output_and_no_step(llm, rng):
    requests = mixed_requests(llm, rng)
    plain, plain_stats = run(llm, requests, overlap=False)
    overlapped, overlapped_stats = run(llm, requests, overlap=True)
    assert overlapped == plain
    assert overlapped_stats == plain_stats, "the overlap must compute nothing that is thrown away"
    reasons = {streamed[-1][3] for streamed in plain.values()}
    assert reasons == {"stop", "length"} and all(s[-1][0] for s in plain.values())


def test_generate_with_overlap_gives_the_plain_results(llm, rng):
    requests = mixed_requests(llm, rng)
    prompts, params = [p for p, _ in requests], [sp for _, sp in requests]
    plain = [summary(o) for o in llm.generate(prompts, params)]
    llm._engine._runner.async_output = True
    try:
        overlapped = [summary(o) for o in llm.generate(prompts, params)]
    finally:
        llm._engine._runner.async_output = False
    assert overlapped == plain


def test_a_request_aborted_while_its_step_runs_gets_no_more_output_and_frees_its_blocks(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    engine = llm._engine
    engine._runner.async_output = True
    params = ob.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = [[int(t) for t in rng.integers(0, 300, int(rng.integers(2, 30)))] for _ in range(4)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, p, params, stream=True)
    victim = str(int(rng.integers(0, 4)))
    outputs: dict[str, list[ob.RequestOutput]] = defaultdict(list)
    for _ in range(int(rng.integers(2, 10))):
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine._launched is not None, "a step is in flight between the calls"
    assert engine.abort(victim)
    seen_before_abort = len(outputs[victim])
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert len(outputs[victim]) == seen_before_abort
    for rid in map(str, range(4)):
        if rid != victim:
            assert outputs[rid][-1].outputs[0].token_ids == alone[int(rid)]
    assert engine.scheduler_stats()["aborted"] == 1
    stats = llm.cache_stats()
    assert stats["free_blocks"] == stats["capacity_blocks"]


def test_a_step_in_flight_when_the_last_request_is_aborted_is_taken_at_once(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    engine = llm._engine
    params = ob.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [int(t) for t in rng.integers(0, 300, 17)]
    alone = llm.generate(prompt, params)[0].outputs[0].token_ids
    engine._runner.async_output = True
    for i in range(3):
        engine.add_request(f"gone-{i}", None, prompt, params)
    engine.step()
    engine.step()
    assert engine._launched is not None, "a step is in flight between the calls"
    engine.abort_all()
    assert engine._launched is None and not engine.has_unfinished(), "the step in flight was taken"
    stats = llm.cache_stats()
    assert stats["free_blocks"] == stats["capacity_blocks"]
    engine.add_request("new", None, prompt, params, stream=True)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"new"}, "the aborted requests' draws are dropped"
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == alone
    stats = llm.cache_stats()
    assert stats["free_blocks"] == stats["capacity_blocks"]


class FailingLaunches:
    """The engine's runner, with ``launch`` failing from its ``fail_at``-th call on."""

    def __init__(self, runner: Any, fail_at: int) -> None:
        self._runner, self._calls, self._fail_at = runner, 0, fail_at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def launch(self, *args: Any) -> Any:
        self._calls += 1
        if self._calls >= self._fail_at:
            raise RuntimeError(f"launch {self._calls} failed")
        return self._runner.launch(*args)


def test_a_failed_launch_is_raised_by_the_next_call_after_the_outputs_before_it(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=2)
    engine = llm._engine
    fail_at = int(rng.integers(2, 6))
    runner = FailingLaunches(engine._runner, fail_at)
    runner.async_output = True
    engine._runner = runner
    params = ob.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("r", None, [int(t) for t in rng.integers(0, 300, 5)], params, stream=True)
    for step in range(1, fail_at):
        outs = engine.step()
        assert [len(o.outputs[0].token_ids) for o in outs] == [step], "each call returns its step's token"
    with pytest.raises(RuntimeError, match=f"launch {fail_at} failed"):
        engine.step()
    engine.abort_all()

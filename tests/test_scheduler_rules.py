"""The scheduler's queue rules one at a time, on both ``oxibonsai._core.Scheduler`` (ledger mode) and the
pure-Python model in ``sched_model.py``: priority overtaking, aging under a steady high-priority stream,
QueueFull, bad calls that change nothing, the preemption order, and chunked prefill next to decodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sched_model import PyScheduler

import oxibonsai as ob
from oxibonsai import QueueFull, _core

NATIVE: Any = getattr(_core, "Scheduler", None)
impls = pytest.mark.parametrize(
    "impl",
    [
        pytest.param("native", marks=pytest.mark.skipif(NATIVE is None, reason="no native Scheduler")),
        "python",
    ],
)


def make(impl: str, num_blocks: int, **config: Any) -> Any:
    return PyScheduler(num_blocks, **config) if impl == "python" else NATIVE(num_blocks, **config)


def run_step(sched: Any, token: int = 1) -> Any:
    """schedule(), execute() (the ledger's forward pass: it takes the step's blocks), update()."""
    out = sched.schedule()
    assert sched.execute(out) is None
    sched.update(out, [token] * sum(1 for item in out.items if item[2]))
    return out


@impls
def test_a_high_priority_request_overtakes_waiting_low_priority_ones(impl: str) -> None:
    sched = make(impl, 8, max_num_seqs=1)
    sched.add(1, [1, 2, 3], priority=2)
    sched.add(2, [1, 2, 3], priority=2)
    run_step(sched)
    sched.add(3, [4, 5, 6], priority=-1)
    assert sched.running_ids() == [1] and sched.waiting_ids() == [3, 2]
    sched.finish(1)
    assert run_step(sched).items == [(3, 3, True)]
    sched.check()


def low_priority_admission_step(impl: str, aging: int, backlog: int, rate: int, horizon: int) -> int | None:
    """One request at a time (max_num_seqs=1), each high-priority request finished after its first token;
    `backlog` high-priority requests wait, then a low one arrives, then `rate` high ones before every step.
    Returns the step that admits the low-priority request, or None within `horizon` steps."""
    sched = make(impl, 4, max_num_seqs=1, priority_aging_steps=aging)
    next_id = iter(range(1, 10**6))
    for _ in range(backlog):
        sched.add(next(next_id), [7, 7, 7, 7], priority=-1)
    sched.add(0, [9, 9, 9, 9], priority=1)
    for _ in range(horizon):
        for _ in range(rate):
            sched.add(next(next_id), [7, 7, 7, 7], priority=-1)
        out = run_step(sched)
        if any(rid == 0 for rid, _, _ in out.items):
            return int(out.step)
        for rid in sched.running_ids():
            sched.finish(rid)
    return None


@impls
def test_aging_admits_a_low_priority_request_under_a_steady_high_priority_stream(impl: str) -> None:
    # The low request (priority 1, enqueued at step 0) has key 1 * A; a high one (priority -1) enqueued
    # before step t has key -A + (t - 1), so only arrivals before steps 1 .. 2A are ahead of it: with
    # `rate` per step, backlog + rate * 2A requests, one admitted per step: admission at step
    # backlog + rate * 2A + 1, although high-priority arrivals outpace service forever.
    aging, backlog, rate = 4, 3, 2
    bound = backlog + rate * 2 * aging + 1
    assert low_priority_admission_step(impl, aging, backlog, rate, 3 * bound) == bound
    assert low_priority_admission_step(impl, 10**6, backlog, rate, 3 * bound) is None  # no aging: starves


@impls
def test_queue_full_at_max_waiting_changes_nothing(impl: str) -> None:
    sched = make(impl, 8, max_waiting=2)
    sched.add(0, [1, 2])
    sched.add(1, [1, 2])
    with pytest.raises(QueueFull):
        sched.add(2, [1, 2])
    assert sched.waiting_ids() == [0, 1] and sched.num_free_blocks == 8
    assert sched.stats()["steps"] == 0
    run_step(sched)
    assert sched.num_waiting == 0 and sched.running_ids() == [0, 1]
    sched.add(2, [1, 2])  # the refused id was never recorded
    assert sched.waiting_ids() == [2]
    sched.check()


@impls
def test_duplicate_id_or_empty_prompt_is_a_value_error(impl: str) -> None:
    sched = make(impl, 8)
    sched.add(0, [1, 2])
    run_step(sched)
    sched.add(1, [1, 2])
    for rid, prompt in ((0, [3]), (1, [3]), (2, []), (2, np.array([], dtype=np.uint32))):
        with pytest.raises(ValueError):
            sched.add(rid, prompt)
    assert sched.running_ids() == [0] and sched.waiting_ids() == [1]
    assert sched.num_free_blocks == 7
    sched.check()


@impls
def test_update_with_the_wrong_number_of_tokens_changes_nothing(impl: str) -> None:
    sched = make(impl, 8)
    sched.add(0, list(range(20)))
    sched.add(1, list(range(5)))
    out = sched.schedule()
    assert out.items == [(0, 20, True), (1, 5, True)]
    sched.execute(out)
    assert sched.num_free_blocks == 8 - 2 - 1
    for sampled in ([], [1], [1, 2, 3]):
        with pytest.raises(ValueError):
            sched.update(out, sampled)
        assert sched.num_free_blocks == 5 and sched.running_ids() == [0, 1]
        sched.check()
    sched.update(out, [5, 6])
    sched.check()
    assert run_step(sched).items == [(0, 1, True), (1, 1, True)]


@impls
def test_preemption_takes_the_lowest_priority_then_the_most_recently_admitted(impl: str) -> None:
    sched = make(impl, 4)
    sched.add(10, list(range(8)), priority=1)  # 1 block; its decodes stay inside it
    run_step(sched)
    for rid in (11, 12, 13):
        sched.add(rid, list(range(16)), priority=0)  # 1 block each; the first decode needs a second
    assert [item[0] for item in run_step(sched).items] == [10, 11, 12, 13]
    assert sched.num_free_blocks == 0
    out = sched.schedule()
    assert out.preempted == [10, 13]
    assert out.items == [(11, 1, True), (12, 1, True)]
    sched.execute(out)
    sched.update(out, [1, 1])
    assert sched.running_ids() == [11, 12] and sched.waiting_ids() == [13, 10]
    assert sched.stats()["preemptions"] == 2
    sched.check()


@impls
def test_chunked_prefill_splits_a_long_prompt_while_decodes_go_on(impl: str) -> None:
    sched = make(impl, 32, max_num_batched_tokens=32)
    sched.add(0, [1, 2, 3, 4])
    run_step(sched)
    sched.add(1, list(range(100)))
    chunks = []
    for _ in range(4):
        out = run_step(sched)
        assert out.items[0] == (0, 1, True) and out.num_batched_tokens == 1 + out.items[1][1]
        chunks.append(out.items[1])
    assert chunks == [(1, 31, False), (1, 31, False), (1, 31, False), (1, 7, True)]
    assert run_step(sched).items == [(0, 1, True), (1, 1, True)]
    sched.check()


@impls
def test_without_chunked_prefill_a_prompt_over_the_budget_waits(impl: str) -> None:
    sched = make(impl, 32, max_num_batched_tokens=32, enable_chunked_prefill=False)
    sched.add(0, [1, 2, 3, 4])
    run_step(sched)
    sched.add(1, list(range(40)))
    for _ in range(3):
        assert run_step(sched).items == [(0, 1, True)]
    assert sched.waiting_ids() == [1]
    sched.check()


@pytest.mark.skipif(NATIVE is None, reason="no native Scheduler")
def test_update_without_execute_is_refused_and_changes_nothing() -> None:
    sched = NATIVE(8)
    sched.add(0, list(range(20)))
    out = sched.schedule()
    with pytest.raises(ValueError, match="execute"):
        sched.update(out, [5])
    assert sched.request_state(0) == (list(range(20)), 0)
    sched.execute(out)
    with pytest.raises(ValueError, match="already executed"):
        sched.execute(out)
    sched.update(out, [5])
    sched.check()
    assert sched.request_state(0) == ([*range(20), 5], 20)
    assert sched.num_free_blocks == 8 - 2


def refuse_a_superseded_plan(sched: Any, prompt: list[int]) -> Any:
    """Adds request 0, plans two steps, checks that executing the first raises and leaves the request
    untouched, and returns the second plan."""
    sched.add(0, prompt)
    old = sched.schedule()
    new = sched.schedule()
    with pytest.raises(ValueError, match="latest schedule"):
        sched.execute(old)
    assert sched.request_state(0) == (prompt, 0)
    return new


@pytest.mark.skipif(NATIVE is None, reason="no native Scheduler")
def test_a_superseded_output_is_refused_and_changes_nothing(rng: np.random.Generator) -> None:
    """Only the latest schedule() can run: an older plan's blocks were promised against a table that
    has moved on since."""
    sched = NATIVE(16)
    prompt = rng.integers(0, 1000, size=int(rng.integers(2, 40))).tolist()
    new = refuse_a_superseded_plan(sched, prompt)
    assert sched.num_free_blocks == 16
    sched.execute(new)
    sched.update(new, [5])
    sched.check()
    assert sched.request_state(0) == ([*prompt, 5], len(prompt))


def test_a_superseded_output_never_runs_the_model(tiny_model: Path, rng: np.random.Generator) -> None:
    llm = ob.LLM(tiny_model, max_model_len=64)
    model = llm._runner._model
    sched = _core.Scheduler(model, max_num_seqs=2)
    prompt = rng.integers(1, 100, size=int(rng.integers(2, 30))).tolist()
    new = refuse_a_superseded_plan(sched, prompt)
    logits = sched.execute(new)
    assert logits is not None and logits.shape[0] == 1
    np.testing.assert_allclose(logits[0], llm.logits(prompt)[-1], rtol=1e-4, atol=1e-4)
    sched.update(new, [int(np.argmax(logits[0]))])
    assert sched.finish(0)
    assert model.num_sequences == 0 and model.num_available_blocks == model.num_blocks


def test_update_accepts_a_uint32_array(rng: np.random.Generator) -> None:
    sched = _core.Scheduler(8)
    prompt = rng.integers(0, 1000, size=5).tolist()
    sched.add(1, prompt)
    out = sched.schedule()
    sched.execute(out)
    token = int(rng.integers(0, 1000))
    sched.update(out, np.array([token], dtype=np.uint32))
    assert sched.request_state(1) == ([*prompt, token], 5)


@pytest.mark.skipif(NATIVE is None, reason="no native Scheduler")
def test_a_prepared_plan_carries_each_requests_prompt_length_also_on_recompute() -> None:
    """``prepare``'s ``decode_from``: the prompt length of each planned sequence's request, also for a
    request recomputing its prompt and sampled tokens after a preemption (the torch runner's
    attention computes the rows from there on as decode rows)."""
    sched = NATIVE(2)
    sched.add(1, list(range(10)))
    sched.add(2, list(range(16)))  # its first decode needs a second block: it is preempted
    steps = []
    for _ in range(2):
        out = sched.schedule()
        plan = sched.prepare(out)
        steps.append((out.items, out.preempted, plan.positions.tolist(), plan.decode_from.tolist()))
        sched.update(out, [7] * sum(1 for item in out.items if item[2]))
    assert steps[0] == ([(1, 10, True), (2, 16, True)], [], list(range(10)) + list(range(16)), [10, 16])
    assert steps[1] == ([(1, 1, True)], [2], [10], [10])
    assert sched.finish(1)
    out = sched.schedule()
    plan = sched.prepare(out)
    assert out.items == [(2, 17, True)], "the prompt and the token sampled before the preemption"
    assert plan.positions.tolist() == list(range(17)) and plan.decode_from.tolist() == [16]

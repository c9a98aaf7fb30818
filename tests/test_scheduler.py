"""The continuous-batching scheduler through ``oxibonsai._core.Scheduler`` in ledger mode (an int pool of
blocks, no model): Hypothesis drives random add / step / finish / abort sequences on it and on the
pure-Python model in ``sched_model.py``; both must schedule, preempt and queue identically, keep their
invariants, and give every block back once everything is finished. A second machine runs the native
ledger with prefix caching on (no model) for invariants and leaks. The plain tests pin the queue rules
(priority, aging, QueueFull, bad calls, preemption order, chunked prefill) on both implementations."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sched_model import BLOCK, PyScheduler

from oxibonsai import QueueFull, _core

NATIVE: Any = getattr(_core, "Scheduler", None)
needs_native = pytest.mark.skipif(NATIVE is None, reason="oxibonsai._core.Scheduler is not built")
impls = pytest.mark.parametrize("impl", [pytest.param("native", marks=needs_native), "python"])

_COUNTS = ("num_waiting", "num_running", "num_free_blocks", "num_available_blocks", "num_blocks")
_STATS = ("steps", "preemptions", "scheduled_tokens", "admitted", "finished", "aborted")


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    chunked = draw(st.booleans())
    # Without chunked prefill, a prompt over the budget blocks the queue: keep that case, but rarer.
    budget = st.integers(1, 8) | st.integers(16, 160) if chunked else st.integers(16, 160)
    return {
        "num_blocks": draw(st.integers(1, 8) | st.integers(1, 40)),
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_num_batched_tokens": draw(budget),
        "enable_chunked_prefill": chunked,
        "max_waiting": draw(st.none() | st.integers(1, 8)),
        "priority_aging_steps": draw(st.sampled_from([1, 3, 16, 256])),
    }


# (prompt length, max_tokens, priority). Prompts of whole blocks make their first decode need a new block,
# so preemptions come early.
requests = st.tuples(
    st.integers(1, 80) | st.sampled_from([16, 32, 48, 64, 80]), st.integers(1, 64), st.integers(-2, 2)
)


def make(impl: str, num_blocks: int, **config: Any) -> Any:
    return PyScheduler(num_blocks, **config) if impl == "python" else NATIVE(num_blocks, **config)


def run_step(sched: Any, token: int = 1) -> Any:
    out = sched.schedule()
    sched.update(out, [token] * sum(1 for item in out.items if item[2]))
    return out


def outcome(call: Any) -> object:
    try:
        return ("ok", call())
    except (ValueError, QueueFull) as e:
        return type(e)


class SchedulerMachine(RuleBasedStateMachine):
    """Native vs model, operation by operation. Requests respect the engine's admission check (prompt +
    max_tokens fits the pool) and are finished at max_tokens, as the engine does at its length stop."""

    @initialize(config=configs())
    def start(self, config: dict[str, Any]) -> None:
        self.num_blocks = config.pop("num_blocks")
        self.native = NATIVE(self.num_blocks, **config)
        self.model = PyScheduler(self.num_blocks, **config)
        self.next_id = 0
        self.max_tokens: dict[int, int] = {}
        self.generated: dict[int, int] = {}

    def both(self, method: str, *args: Any, **kwargs: Any) -> Any:
        got = outcome(lambda: getattr(self.native, method)(*args, **kwargs))
        want = outcome(lambda: getattr(self.model, method)(*args, **kwargs))
        assert got == want, (method, args, got, want)
        return got

    def forget(self, request_id: int, method: str = "finish") -> None:
        assert self.both(method, request_id) == ("ok", True)
        del self.max_tokens[request_id], self.generated[request_id]

    @rule(requests=st.lists(requests, min_size=1, max_size=4))
    def add(self, requests: list[tuple[int, int, int]]) -> None:
        room = self.num_blocks * BLOCK
        for length, max_tokens, priority in requests:
            max_tokens = min(max_tokens, room - 1)
            length = min(length, room - max_tokens)
            rid = self.next_id
            self.next_id += 1
            prompt = [(rid * 31 + i) % 1000 for i in range(length)]
            if self.both("add", rid, prompt, priority=priority) == ("ok", None):
                self.max_tokens[rid], self.generated[rid] = max_tokens, 0

    @precondition(lambda self: self.model.num_waiting + self.model.num_running > 0)
    @rule(count=st.integers(1, 8), data=st.data())
    def steps(self, count: int, data: st.DataObject) -> None:
        for _ in range(count):
            self.step(data)

    def step(self, data: st.DataObject) -> None:
        got, want = self.native.schedule(), self.model.schedule()
        assert got.step == want.step
        assert list(got.items) == want.items
        assert list(got.preempted) == want.preempted
        assert got.num_batched_tokens == want.num_batched_tokens == sum(n for _, n, _ in want.items)
        # The engine may finish or abort scheduled requests before update(): their tokens are dropped.
        ids = [rid for rid, _, _ in want.items]
        for rid in data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=1)) if ids else []:
            self.forget(rid, data.draw(st.sampled_from(["finish", "abort"])))
        num_sample = sum(1 for item in want.items if item[2])
        sampled = data.draw(st.lists(st.integers(0, 150_000), min_size=num_sample, max_size=num_sample))
        self.native.update(got, sampled)
        self.model.update(want, sampled)
        for rid, _, sample in want.items:
            if sample and rid in self.generated:
                self.generated[rid] += 1
                if self.generated[rid] >= self.max_tokens[rid]:
                    self.forget(rid)

    @precondition(lambda self: self.model.num_running > 0)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.forget(data.draw(st.sampled_from(self.model.running_ids())))

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.integers(0, self.next_id + 2))  # known, finished or never seen
        known = rid in self.max_tokens
        assert self.both("abort", rid) == ("ok", known)
        if known:
            del self.max_tokens[rid], self.generated[rid]

    @invariant()
    def agree_and_hold_together(self) -> None:
        self.native.check()
        self.model.check()
        for name in _COUNTS:
            assert getattr(self.native, name) == getattr(self.model, name), name
        assert self.native.running_ids() == self.model.running_ids()
        assert self.native.waiting_ids() == self.model.waiting_ids()
        assert sorted(self.model.running_ids() + self.model.waiting_ids()) == sorted(self.max_tokens)
        stats = self.native.stats()
        for name in _STATS:
            assert stats[name] == self.model.stats()[name], name

    def teardown(self) -> None:
        if not hasattr(self, "model"):
            return
        for rid in list(self.max_tokens):
            self.forget(rid)
        for sched in (self.native, self.model):
            sched.check()
            assert sched.num_free_blocks == self.num_blocks, "a block leaked"
            assert sched.num_waiting == sched.num_running == 0
            assert sched.running_ids() == sched.waiting_ids() == []


TestSchedulerMachine = needs_native(SchedulerMachine.TestCase)
TestSchedulerMachine.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- plain tests, on both implementations ---------------------------------------------------------------


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
    for sampled in ([], [1], [1, 2, 3]):
        with pytest.raises(ValueError):
            sched.update(out, sampled)
        assert sched.num_free_blocks == 8 and sched.running_ids() == [0, 1]
        sched.check()
    sched.update(out, [5, 6])
    assert sched.num_free_blocks == 8 - 2 - 1
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

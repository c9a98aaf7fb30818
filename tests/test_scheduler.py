"""The continuous-batching scheduler through ``oxibonsai._core.Scheduler`` in ledger mode (an int pool of
blocks, no model): Hypothesis drives random add / step / finish / abort sequences on it and on the
pure-Python model in ``sched_model.py``; both must schedule, preempt and queue identically, keep their
invariants, and give every block back once everything is finished. A second machine runs the native
ledger alone with prefix caching on, for its invariants and leaks. The queue rules one by one are in
``test_scheduler_rules.py``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sched_model import BLOCK, PyScheduler

from oxibonsai import QueueFull, _core

NATIVE: Any = getattr(_core, "Scheduler", None)
needs_native = pytest.mark.skipif(NATIVE is None, reason="oxibonsai._core.Scheduler is not built")

_COUNTS = ("num_waiting", "num_running", "num_free_blocks", "num_available_blocks", "num_blocks")
_STATS = ("steps", "preemptions", "scheduled_tokens", "admitted", "finished", "aborted")


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly a contended pool with chunked prefill; the corner settings (one sequence, a tiny budget,
    no chunking, a bounded queue) a quarter of the time each, so preempting runs stay common."""

    def mostly(usual: st.SearchStrategy[Any], corner: st.SearchStrategy[Any]) -> Any:
        return draw(corner if draw(st.integers(0, 3)) == 3 else usual)

    chunked = mostly(st.just(True), st.just(False))
    max_num_seqs = mostly(st.integers(2, 8), st.just(1))
    # Without chunked prefill a prompt over the budget blocks the queue: that case stays rare.
    budget = mostly(st.integers(48, 160), st.integers(max_num_seqs, 8) if chunked else st.integers(16, 47))
    return {
        "num_blocks": mostly(st.integers(2, 12), st.integers(1, 40)),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "enable_chunked_prefill": chunked,
        "max_waiting": mostly(st.none(), st.integers(1, 8)),
        "priority_aging_steps": draw(st.sampled_from([1, 3, 16, 256])),
    }


# (prompt length, max_tokens, priority). Prompts of whole blocks make their first decode need a new block,
# so preemptions come early.
requests = st.tuples(
    st.integers(1, 80) | st.sampled_from([16, 32, 48, 64, 80]), st.integers(1, 64), st.integers(-2, 2)
)


def outcome(call: Any) -> object:
    try:
        return ("ok", call())
    except (ValueError, QueueFull) as e:
        return type(e)


class SchedulerMachine(RuleBasedStateMachine):
    """Native vs model, operation by operation. Requests respect the engine's admission check (prompt +
    max_tokens fits the pool) and are finished at max_tokens, as the engine does at its length stop."""

    @initialize(config=configs(), backlog=st.lists(requests, min_size=2, max_size=6))
    def start(self, config: dict[str, Any], backlog: list[tuple[int, int, int]]) -> None:
        self.num_blocks = config.pop("num_blocks")
        self.native = NATIVE(self.num_blocks, **config)
        self.model = PyScheduler(self.num_blocks, **config)
        self.next_id = 0
        self.max_tokens: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        self.add(backlog)  # every run starts loaded: Hypothesis's simplest runs would otherwise idle

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
    @rule(count=st.integers(1, 16), data=st.data())
    def steps(self, count: int, data: st.DataObject) -> None:
        for _ in range(count):
            self.step(data)

    def step(self, data: st.DataObject) -> None:
        got, want = self.native.schedule(), self.model.schedule()
        assert got.step == want.step
        assert list(got.items) == want.items
        assert list(got.preempted) == want.preempted
        assert got.num_batched_tokens == want.num_batched_tokens == sum(n for _, n, _ in want.items)
        self.drop_some(data, want.items)
        assert self.native.execute(got) is None
        self.model.execute(want)
        assert self.native.num_free_blocks == self.model.num_free_blocks
        self.native.check()
        self.model.check()
        self.drop_some(data, want.items)
        num_sample = sum(1 for item in want.items if item[2])
        sampled = data.draw(st.lists(st.integers(0, 150_000), min_size=num_sample, max_size=num_sample))
        self.native.update(got, sampled)
        self.model.update(want, sampled)
        for rid, _, sample in want.items:
            if sample and rid in self.generated:
                self.generated[rid] += 1
                if self.generated[rid] >= self.max_tokens[rid]:
                    self.forget(rid)

    def drop_some(self, data: st.DataObject, items: list[tuple[int, int, bool]]) -> None:
        """The engine may finish or abort scheduled requests mid-step: their items are then skipped."""
        ids = [rid for rid, _, _ in items if rid in self.max_tokens]
        for rid in data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=1)) if ids else []:
            self.forget(rid, data.draw(st.sampled_from(["finish", "abort"])))

    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        """One rule, so that ending requests is not twice as likely as adding them."""
        running = self.model.running_ids()
        if running and data.draw(st.booleans()):  # the engine's stop: a running request ends
            self.forget(data.draw(st.sampled_from(running)))
            return
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
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- the native ledger with prefix caching on ----------------------------------------------------------

# A prompt is the first 0..4 blocks of one of two fixed chains, then 0..20 tokens of its own: cached
# prefixes are found often, and whole-block prompts (reused up to their last block) are common.
CHAINS = [[[c * 1000 + p * 100 + i for i in range(BLOCK)] for p in range(4)] for c in range(2)]
cached_requests = st.tuples(
    st.integers(0, 1),
    st.integers(0, 4),
    st.integers(0, 20) | st.just(0),
    st.integers(1, 64),
    st.integers(-2, 2),
    st.sampled_from([None, "tenant-a"]),
)


class CachedLedgerMachine(RuleBasedStateMachine):
    """The native ledger with prefix caching, alone: every plan must be well formed (running ids, the
    budget, `sample` exactly at the last token), the invariants must hold, and once everything is
    finished every block is free or idle in the cache (`num_available_blocks == num_blocks`)."""

    @initialize(
        config=configs(),
        num_blocks=st.integers(1, 12),
        policy=st.sampled_from(["priority", "longest_prefix"]),
        backlog=st.lists(cached_requests, min_size=2, max_size=6),
    )
    def start(self, config: dict[str, Any], num_blocks: int, policy: str, backlog: list[Any]) -> None:
        del config["num_blocks"]  # a small pool: cached blocks must be evicted and requests preempted
        self.num_blocks = num_blocks
        self.budget = config["max_num_batched_tokens"]
        self.max_num_seqs = config["max_num_seqs"]
        self.sched = NATIVE(self.num_blocks, policy=policy, enable_prefix_caching=True, **config)
        self.next_id = 0
        self.max_tokens: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        self.add(backlog)

    def forget(self, request_id: int, method: str = "finish") -> None:
        assert getattr(self.sched, method)(request_id)
        del self.max_tokens[request_id], self.generated[request_id]

    @rule(requests=st.lists(cached_requests, min_size=1, max_size=4))
    def add(self, requests: list[tuple[int, int, int, int, int, str | None]]) -> None:
        room = self.num_blocks * BLOCK
        for chain, blocks, tail, max_tokens, priority, salt in requests:
            max_tokens = min(max_tokens, room - 1)
            prompt = [t for block in CHAINS[chain][:blocks] for t in block] + list(range(tail)) or [1]
            prompt = prompt[: room - max_tokens]
            rid = self.next_id
            self.next_id += 1
            try:
                self.sched.add(rid, prompt, priority=priority, cache_salt=salt)
            except QueueFull:
                continue
            self.max_tokens[rid], self.generated[rid] = max_tokens, 0

    @precondition(lambda self: self.sched.num_waiting + self.sched.num_running > 0)
    @rule(count=st.integers(1, 32), data=st.data())
    def steps(self, count: int, data: st.DataObject) -> None:
        for _ in range(count):
            self.step(data)

    def step(self, data: st.DataObject) -> None:
        running = set(self.sched.running_ids())
        out = self.sched.schedule()
        ids = [rid for rid, _, _ in out.items]
        assert len(set(ids)) == len(ids) and set(ids) <= set(self.sched.running_ids())
        assert set(out.preempted) <= running and set(out.preempted) <= set(self.sched.waiting_ids())
        if out.preempted:
            assert set(ids) <= running, "a step that preempts admits nothing"
        assert out.num_batched_tokens == sum(n for _, n, _ in out.items) <= self.budget
        for rid, n, sample in out.items:
            tokens, computed = self.sched.request_state(rid)
            assert n >= 1 and computed + n <= len(tokens) and sample == (computed + n == len(tokens))
        self.drop_some(data, ids)
        assert self.sched.execute(out) is None
        self.drop_some(data, ids)
        sampled = data.draw(st.lists(st.integers(0, 50), min_size=out.num_sample, max_size=out.num_sample))
        self.sched.update(out, sampled)
        for rid, _, sample in out.items:
            if sample and rid in self.generated:
                self.generated[rid] += 1
                if self.generated[rid] >= self.max_tokens[rid]:
                    self.forget(rid)

    def drop_some(self, data: st.DataObject, ids: list[int]) -> None:
        live = [rid for rid in ids if rid in self.max_tokens]
        for rid in data.draw(st.lists(st.sampled_from(live), unique=True, max_size=1)) if live else []:
            self.forget(rid, data.draw(st.sampled_from(["finish", "abort"])))

    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        running = self.sched.running_ids()
        if running and data.draw(st.booleans()):
            self.forget(data.draw(st.sampled_from(running)))
            return
        rid = data.draw(st.integers(0, self.next_id + 2))
        known = rid in self.max_tokens
        assert self.sched.abort(rid) == known
        if known:
            del self.max_tokens[rid], self.generated[rid]

    @invariant()
    def holds_together(self) -> None:
        s = self.sched
        s.check()
        assert s.num_running <= self.max_num_seqs
        assert s.num_free_blocks <= s.num_available_blocks <= s.num_blocks == self.num_blocks
        running, waiting = s.running_ids(), s.waiting_ids()
        assert len(running) == s.num_running and len(waiting) == s.num_waiting
        assert sorted(running + waiting) == sorted(self.max_tokens)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for rid in list(self.max_tokens):
            self.forget(rid)
        self.sched.check()
        assert self.sched.num_available_blocks == self.num_blocks, "a block leaked"
        assert self.sched.num_waiting == self.sched.num_running == 0


TestCachedLedgerMachine = needs_native(CachedLedgerMachine.TestCase)
TestCachedLedgerMachine.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

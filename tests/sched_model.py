"""A pure-Python model of ``oxibonsai._core.Scheduler`` in ledger mode (an int pool of 16-token blocks,
prefix caching off), with the same rules and method names, for the property tests and the benchmark.

The rules, in brief: the waiting queue is ordered by ``(key, arrival)`` with ``key = priority *
priority_aging_steps + enqueue_step`` (a heap with lazily dropped entries for aborted requests); the
running set is kept sorted by ``(priority, admitted)``. ``schedule()`` visits running decodes, then
running prefills, each in that order, spending the token budget and promising new blocks; when blocks run
short it preempts the not-yet-scheduled running request with the largest ``(priority, admitted)``. Only
a step without preemptions admits waiting requests, head first (without prefix caching the
"longest_prefix" policy picks the head too). ``execute()`` (the ledger's forward pass) takes the blocks
the step's tokens need, as the native ledger does; ``update()`` then advances ``num_computed`` and
appends the sampled tokens. The model never finishes a request: the caller decides, as the engine does."""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass, field

from oxibonsai import QueueFull

BLOCK = 16


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


class _Request:
    __slots__ = ("admitted", "arrival", "blocks", "id", "key", "num_computed", "priority", "tokens")

    def __init__(self, request_id: int, tokens: list[int], priority: int, key: int, arrival: int) -> None:
        self.id = request_id
        self.tokens = tokens
        self.priority = priority
        self.key = key
        self.arrival = arrival
        self.num_computed = 0
        self.blocks = 0  # held: blocks_for(num_computed), or more between execute() and update()
        self.admitted = 0

    def rank(self) -> tuple[int, int, int]:
        """Position in the running set: lower priority value, then earlier admission, first."""
        return (self.priority, self.admitted, self.id)


@dataclass
class PySchedulerOutput:
    step: int
    items: list[tuple[int, int, bool]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_sample: int = 0


class PyScheduler:
    def __init__(
        self,
        num_blocks: int,
        *,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 256,
        max_waiting: int | None = None,
        priority_aging_steps: int = 256,
        enable_chunked_prefill: bool = True,
        policy: str = "priority",
    ) -> None:
        if num_blocks < 1 or max_num_seqs < 1:
            raise ValueError("num_blocks and max_num_seqs must be >= 1")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every decode fits a step)")
        if not 1 <= priority_aging_steps <= 2**32 - 1:
            raise ValueError("priority_aging_steps must be in 1..2**32-1")
        if policy not in ("priority", "longest_prefix"):
            raise ValueError(f"unknown policy {policy!r}")
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.aging = priority_aging_steps
        self.chunked = enable_chunked_prefill
        self.free = num_blocks
        self.step = 0
        self.requests: dict[int, _Request] = {}
        self.waiting: dict[int, _Request] = {}
        self.running: dict[int, _Request] = {}
        self._heap: list[tuple[int, int, _Request]] = []  # (key, arrival, request); stale if not waiting
        self._order: list[tuple[int, int, int]] = []  # running ranks, sorted
        self._arrivals = 0
        self._admissions = 0
        self._pending: PySchedulerOutput | None = None
        self.counters = dict(steps=0, preemptions=0, scheduled_tokens=0, admitted=0, finished=0, aborted=0)

    # -- queries --------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.free

    @property
    def num_available_blocks(self) -> int:
        return self.free

    def running_ids(self) -> list[int]:
        return sorted(self.running, key=lambda i: self.running[i].admitted)

    def waiting_ids(self) -> list[int]:
        return [r.id for _, _, r in sorted(e for e in self._heap if self.waiting.get(e[2].id) is e[2])]

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    # -- requests -------------------------------------------------------------------------------

    def add(self, request_id: int, prompt: Sequence[int], *, priority: int = 0) -> None:
        if request_id in self.requests:
            raise ValueError(f"request {request_id} is already known")
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting")
        key = priority * self.aging + self.step
        r = _Request(request_id, [int(t) for t in prompt], priority, key, self._arrivals)
        self._arrivals += 1
        self.requests[request_id] = r
        self._enqueue(r)

    def finish(self, request_id: int) -> bool:
        return self._remove(request_id, "finished")

    def abort(self, request_id: int) -> bool:
        return self._remove(request_id, "aborted")

    # -- the step -------------------------------------------------------------------------------

    def schedule(self) -> PySchedulerOutput:
        self.step += 1
        self.counters["steps"] += 1
        out = PySchedulerOutput(self.step)
        scheduled: set[int] = set()
        budget, reserved = self.max_num_batched_tokens, 0
        order = [self.running[rank[2]] for rank in self._order]
        decodes = [r for r in order if len(r.tokens) - r.num_computed == 1]
        prefills = [r for r in order if len(r.tokens) - r.num_computed > 1]
        for r in decodes + prefills:
            if budget <= 0:
                break
            if r.id not in self.running:
                continue  # preempted earlier in this step
            remaining = len(r.tokens) - r.num_computed
            n = min(remaining, budget)
            if n < remaining and not self.chunked:
                continue
            need = blocks_for(r.num_computed + n) - r.blocks
            while need > self.free - reserved:
                victim = self._victim(scheduled)
                self._preempt(victim)
                out.preempted.append(victim.id)
                if victim is r:
                    break
            else:
                scheduled.add(r.id)
                out.items.append((r.id, n, r.num_computed + n == len(r.tokens)))
                budget -= n
                reserved += need
        if not out.preempted:
            budget = self._admit(out, budget, reserved)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.num_sample = sum(1 for item in out.items if item[2])
        self.counters["scheduled_tokens"] += out.num_batched_tokens
        self._pending = out
        return out

    def execute(self, out: PySchedulerOutput) -> None:
        """The ledger's forward pass: every item's request takes the blocks its new tokens need."""
        for request_id, n, _ in out.items:
            r = self.running.get(request_id)
            if r is not None:  # else finished or aborted since schedule()
                grown = blocks_for(r.num_computed + n)
                self.free -= grown - r.blocks
                r.blocks = grown

    def update(self, out: PySchedulerOutput, sampled: Sequence[int]) -> None:
        if out is not self._pending:
            raise ValueError("update() takes the output of the latest schedule(), once")
        if len(sampled) != out.num_sample:
            raise ValueError(f"{len(sampled)} sampled tokens for {out.num_sample} sampling items")
        self._pending = None
        values = iter(sampled)
        for request_id, n, sample in out.items:
            token = int(next(values)) if sample else 0
            r = self.running.get(request_id)
            if r is None:
                continue  # finished or aborted since schedule()
            r.num_computed += n
            if sample:
                r.tokens.append(token)

    # -- internals ------------------------------------------------------------------------------

    def _admit(self, out: PySchedulerOutput, budget: int, reserved: int) -> int:
        while len(self.running) < self.max_num_seqs and budget > 0:
            r = self._head()
            if r is None:
                break
            n = min(len(r.tokens), budget)
            if n < len(r.tokens) and not self.chunked:
                break
            need = blocks_for(n)
            if need > self.free - reserved:
                break
            heapq.heappop(self._heap)
            del self.waiting[r.id]
            self._admissions += 1
            r.admitted = self._admissions
            self.running[r.id] = r
            insort(self._order, r.rank())
            self.counters["admitted"] += 1
            out.items.append((r.id, n, n == len(r.tokens)))
            budget -= n
            reserved += need
        return budget

    def _head(self) -> _Request | None:
        heap = self._heap
        while heap and self.waiting.get(heap[0][2].id) is not heap[0][2]:
            heapq.heappop(heap)  # an aborted request's entry
        return heap[0][2] if heap else None

    def _enqueue(self, r: _Request) -> None:
        self.waiting[r.id] = r
        heapq.heappush(self._heap, (r.key, r.arrival, r))

    def _victim(self, scheduled: set[int]) -> _Request:
        for rank in reversed(self._order):
            if rank[2] not in scheduled:
                return self.running[rank[2]]
        raise AssertionError("no preemptible request: the visited one is always a candidate")

    def _unrun(self, r: _Request) -> None:
        """Take a running request out of the running set and give its blocks back."""
        self.free += r.blocks
        r.num_computed = r.blocks = 0
        del self.running[r.id]
        del self._order[bisect_left(self._order, r.rank())]

    def _preempt(self, r: _Request) -> None:
        self._unrun(r)
        self._enqueue(r)
        self.counters["preemptions"] += 1

    def _remove(self, request_id: int, counter: str) -> bool:
        r = self.requests.pop(request_id, None)
        if r is None:
            return False
        if request_id in self.running:
            self._unrun(r)
        else:
            del self.waiting[request_id]
            if len(self._heap) > 2 * len(self.waiting) + 64:
                self._heap = [e for e in self._heap if self.waiting.get(e[2].id) is e[2]]
                heapq.heapify(self._heap)
        self.counters[counter] += 1
        return True

    def check(self) -> None:
        held = sum(r.blocks for r in self.running.values())
        settled = self._pending is not None or all(
            r.blocks == blocks_for(r.num_computed) for r in self.running.values()
        )
        queued = [e[2] for e in self._heap if self.waiting.get(e[2].id) is e[2]]
        problems = [
            (held + self.free != self.num_blocks, "held + free != num_blocks"),
            (self.free < 0, "negative free blocks"),
            (
                any(r.num_computed or r.blocks for r in self.waiting.values()),
                "a waiting request holds blocks",
            ),
            (not settled, "a running request holds other than blocks_for(num_computed) blocks"),
            (len(self.running) > self.max_num_seqs, "too many running"),
            (self.running.keys() & self.waiting.keys(), "a request both running and waiting"),
            (self.running.keys() | self.waiting.keys() != self.requests.keys(), "a request nowhere"),
            (len(queued) != len(self.waiting), "waiting queue and heap disagree"),
            (self._order != sorted(r.rank() for r in self.running.values()), "running order is stale"),
        ]
        for broken, what in problems:
            if broken:
                raise AssertionError(what)

"""The scheduler's step: ``oxibonsai._core.Scheduler`` (Rust, ledger mode: block accounting, no model)
against the pure-Python model with the same rules (``tests/sched_model.py``), one ``schedule()`` +
``execute()`` + ``update()`` cycle at 64 running requests (a ledger's ``execute`` only takes the step's
blocks). "decode": 64 requests in steady decode (one token each per step). "mixed": 64 running; after
every step the two oldest finish and two 64-token prompts arrive, so a step carries about 62 decodes and
two prefills (the finish/add calls are part of the cycle there). Both implementations run the same
workload and are checked to schedule it identically. Per group: each implementation alone, then
"interleaved", which alternates one Rust cycle and one Python cycle and reports the ratio of their
medians (the fairest figure on a shared machine). Target: Python / Rust >= 20x.

    python -m pytest benches/bench_scheduler.py --benchmark-only --benchmark-group-by=group
"""

from __future__ import annotations

import statistics
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sched_model import PyScheduler

from oxibonsai import _core

RUNNING = 64
ROUNDS = 2000
WARMUP = 100
IMPLS = ("rust", "python")
WORKLOADS = ("decode", "mixed")

pytestmark = pytest.mark.skipif(
    not hasattr(_core, "Scheduler"), reason="oxibonsai._core.Scheduler is not built"
)


class Workload:
    """One scheduler and the engine's side of its steps: sampled tokens in; in "mixed", the two oldest
    requests finished and two new prompts added after every step."""

    def __init__(self, impl: str, kind: str) -> None:
        prompt_len = 32 if kind == "decode" else 64
        # Enough blocks for every request to grow through all rounds: nothing is ever preempted.
        num_blocks = RUNNING * (prompt_len + 2 * (ROUNDS + 2 * WARMUP)) // 16
        config = dict(max_num_seqs=RUNNING, max_num_batched_tokens=256)
        cls = PyScheduler if impl == "python" else _core.Scheduler
        self.sched = cls(num_blocks, **config)
        self.kind = kind
        self.prompt = list(range(1000, 1000 + prompt_len))
        self.sampled = [7] * RUNNING
        self.live: deque[int] = deque()
        self.next_id = 0
        for _ in range(RUNNING):
            self.add()
        self.cycle = self.decode_cycle if kind == "decode" else self.mixed_cycle

    def add(self) -> None:
        self.sched.add(self.next_id, self.prompt)
        self.live.append(self.next_id)
        self.next_id += 1

    def decode_cycle(self) -> Any:
        sched = self.sched
        out = sched.schedule()
        sched.execute(out)
        sched.update(out, self.sampled)
        return out

    def any_step(self) -> Any:
        sched = self.sched
        out = sched.schedule()
        sched.execute(out)
        sched.update(out, self.sampled[: out.num_sample])
        return out

    def mixed_cycle(self) -> Any:
        out = self.any_step()
        self.sched.finish(self.live.popleft())
        self.sched.finish(self.live.popleft())
        self.add()
        self.add()
        return out

    def warm_up(self) -> Iterator[tuple[Any, ...]]:
        """Steps until the workload is steady; yields each step's schedule for the cross-check."""
        for _ in range(WARMUP):
            out = self.any_step() if self.kind == "decode" else self.cycle()
            yield (list(out.items), list(out.preempted), out.num_batched_tokens)
        if self.kind == "decode":
            assert self.sched.num_running == RUNNING and self.sched.num_waiting == 0


def workloads(kind: str) -> dict[str, Workload]:
    """Both implementations' workloads, warmed up side by side and checked to schedule identically."""
    built = {impl: Workload(impl, kind) for impl in IMPLS}
    for rust, python in zip(built["rust"].warm_up(), built["python"].warm_up(), strict=True):
        assert rust == python
    return built


@pytest.fixture(scope="module")
def ratios(pytestconfig: pytest.Config) -> Iterator[dict[str, float]]:
    found: dict[str, float] = {}
    yield found
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not found:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for group, ratio in found.items():
            reporter.write_line(f"scheduler {group}: Python / Rust = {ratio:.1f}x (interleaved medians)")


@pytest.mark.parametrize("kind", WORKLOADS)
@pytest.mark.parametrize("impl", IMPLS)
def test_cycle(benchmark: Any, impl: str, kind: str) -> None:
    benchmark.group = f"{kind}-{RUNNING}"
    work = workloads(kind)[impl]
    benchmark.pedantic(work.cycle, rounds=ROUNDS, warmup_rounds=1)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_interleaved(benchmark: Any, kind: str, ratios: dict[str, float]) -> None:
    benchmark.group = f"{kind}-{RUNNING}"
    built = workloads(kind)
    times: dict[str, list[int]] = {impl: [] for impl in IMPLS}

    def both() -> None:
        for impl in IMPLS:
            start = perf_counter_ns()
            built[impl].cycle()
            times[impl].append(perf_counter_ns() - start)

    benchmark.pedantic(both, rounds=ROUNDS, warmup_rounds=0)
    medians = {impl: statistics.median(t) / 1000 for impl, t in times.items()}
    ratio = medians["python"] / medians["rust"]
    benchmark.extra_info.update(
        rust_median_us=medians["rust"], python_median_us=medians["python"], ratio=ratio
    )
    ratios[f"{kind}-{RUNNING}"] = ratio

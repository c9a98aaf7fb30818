"""How the run measures and paces itself: wall-clock, CUDA-event and CUDA-graph timing, GB/s, the
global time budget, the guard that records one case's error and goes on, and the probe section
(versions, the device, copy GB/s: B1), and ``environment``, a variable set for a while (the switches
a runner or an op set reads when made)."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from .plan import Plan


@contextmanager
def environment(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block, restored after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


@dataclass
class Budget:
    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def over(self) -> bool:
        return self.spent() > self.seconds

    def skipped(self) -> dict[str, str]:
        return {"skipped": f"time budget of {self.seconds:.0f} s spent"}

    def share(self, fraction: float) -> Budget:
        """The same clock with an earlier deadline, so one section cannot starve the ones after it."""
        return Budget(self.seconds * fraction, self.start)


def guarded(fn: Callable[[], dict[str, Any]], **label: Any) -> dict[str, Any]:
    """``fn()``, or its error as a record: one failing case never loses the others."""
    try:
        return {**label, **fn()}
    except Exception as e:  # recorded, and the run goes on
        traceback.print_exc()
        return {**label, "error": f"{type(e).__name__}: {e}"}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- timing -------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall-clock ms of ``fn()`` with the device drained before and after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def loop_ms(calls: Sequence[Callable[[], object]], device: torch.device) -> float:
    """ms for one pass over ``calls`` (CUDA events on a GPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for call in calls:
        call()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end))


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end))


def time_calls(calls: Sequence[Callable[[], object]], device: torch.device, reps: int) -> dict[str, Any]:
    """Per-call ms over ``calls``: from CUDA graph replays on a GPU (no launch gaps), wall clock
    elsewhere; ``eager_ms`` is one plain pass, launch overhead included."""
    for call in calls:
        call()  # compile, allocate
    sync(device)
    eager = loop_ms(calls, device) / len(calls)
    if device.type != "cuda":
        return {"ms": statistics.median(loop_ms(calls, device) for _ in range(reps)) / len(calls),
                "eager_ms": eager, "timing": "wall"}  # fmt: skip
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
    except Exception as e:  # fall back to events, and say so
        sync(device)
        return {"ms": statistics.median(loop_ms(calls, device) for _ in range(reps)) / len(calls),
                "eager_ms": eager, "timing": f"events (graph capture failed: {e})"}  # fmt: skip
    replay_ms(graph)
    return {"ms": statistics.median(replay_ms(graph) for _ in range(reps)) / len(calls),
            "eager_ms": eager, "timing": "cuda_graph"}  # fmt: skip


def gbps(nbytes: float, ms: float | None) -> float | None:
    return nbytes / (ms * 1e-3) / 1e9 if ms else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- probe ----------------------------------------------------------------------------------------------


def probe(plan: Plan, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "triton": package_version("triton"),
                           "python": platform.python_version(), "device": str(device)}  # fmt: skip
    if device.type == "cuda":
        from oxibonsai.torch_backend.ops import pdl

        props = torch.cuda.get_device_properties(device)
        out |= {"name": props.name, "sms": props.multi_processor_count, "total_memory": props.total_memory,
                "l2_bytes": getattr(props, "L2_cache_size", None), "pdl": pdl.enabled(device)}  # fmt: skip
    src = torch.randint(0, 255, (plan.copy_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    d2d = statistics.median(loop_ms([partial(dst.copy_, src)], device) for _ in range(plan.reps))
    out["copy_bytes"] = plan.copy_bytes
    out["d2d_gbps"] = gbps(2 * plan.copy_bytes, d2d)
    cuda = device.type == "cuda"
    host = torch.empty(plan.copy_bytes, dtype=torch.uint8, pin_memory=cuda)
    out["h2d_gbps"] = gbps(plan.copy_bytes, wall_ms(lambda: dst.copy_(host, non_blocking=cuda), device, 1, 5))
    out["d2h_gbps"] = gbps(plan.copy_bytes, wall_ms(lambda: host.copy_(dst, non_blocking=cuda), device, 1, 5))
    return out


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None

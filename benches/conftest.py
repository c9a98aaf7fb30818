"""Benchmark fixtures: one shape's workload at a time, thread counts, and the bandwidth ceiling.

`workload` is session-scoped and parametrized by shape, so pytest runs one shape's benchmarks together
and frees its pool of matrices before building the next. The machine-info hook stores the kernel
dispatch, SIMD flags and measured read bandwidth in the --benchmark-json output for report.py.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from bandwidth import GIB, read_bandwidth_gbs
from threads import blas_threads, limit_threads
from workload import QUICK, SHAPES, Workload

from oxibonsai import kernel_info

THREADS = (1, 2)
BANDWIDTH_BYTES = (16 << 20) if QUICK else GIB


@functools.cache
def _read_bandwidth(threads: int) -> float:
    return read_bandwidth_gbs(threads, BANDWIDTH_BYTES)


@pytest.fixture(scope="session", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def workload(request: pytest.FixtureRequest) -> Workload:
    return Workload.build(*request.param)


@pytest.fixture(params=THREADS, ids=lambda t: f"t{t}")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    if request.param > (os.cpu_count() or 1):
        pytest.skip(f"{request.param} threads on {os.cpu_count()} cores")
    with limit_threads(request.param):
        yield request.param


@pytest.fixture(scope="session")
def read_bandwidth() -> Callable[[int], float]:
    """GB/s this machine reads with a given number of threads, measured once per session."""
    return _read_bandwidth


@pytest.fixture(scope="session")
def gemv_means() -> dict[tuple[Any, ...], float]:
    """Mean seconds of each (shape, residency, threads, kernel) at n=1, for per-row cost ratios."""
    return {}


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    machine_info["oxibonsai_kernel_info"] = kernel_info()
    machine_info["blas_threads_default"] = blas_threads()
    machine_info["read_bandwidth_gbs"] = {t: _read_bandwidth(t) for t in THREADS}
    machine_info["bench_quick"] = QUICK
    machine_info["simd_flags"] = _simd_flags()


def _simd_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return ""
    for line in cpuinfo.read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags = line.split(":", 1)[1].split()
            return " ".join(f for f in flags if f.startswith(("avx", "sse4", "fma", "f16c", "bmi", "asimd")))
    return ""

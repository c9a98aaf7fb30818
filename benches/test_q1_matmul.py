"""Q1_0 matmul benchmarks: our kernels against numpy and our sign-flip kernel, on Bonsai-1.7B shapes.

Every (shape, residency, threads, n) is one pytest-benchmark group holding the same six
implementations, so each group's table compares them directly:

- numpy-q1:  numpy straight from the GGUF bytes (baselines.numpy_q1_matmul)
- numpy-f32: BLAS on the pre-dequantized float32 matrix (`w32 @ x`; 28x the bytes of Q1_0)
- signflip:  our int8 sign-flip kernel
- lut:       our LUT GEMV (for n > 1, one GEMV per activation row)
- gemm:      our small-GEMM kernel (AVX-512 VNNI where the CPU has it, else the LUT GEMM)
- lut-gemm:  our LUT small GEMM (the VNNI machines' previous GEMM)

n=1 passes a (cols,) vector, n>1 an (n, cols) matrix. Weight GB/s counts Q1_0 bytes for every
implementation, so it is proportional to speed; "% of bandwidth" counts the bytes each one reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from baselines import numpy_q1_matmul, random_q1_bytes
from threads import settle_blas
from workload import RESIDENCIES, Workload

from oxibonsai import Q1Matrix, kernel_info

IMPLS = ("numpy-q1", "numpy-f32", "signflip", "lut", "lut-gemm", "gemm")
BATCHES = (1, 4, 16, 64)


def make_call(workload: Workload, impl: str, residency: str, x: np.ndarray) -> tuple[Callable[[], Any], int]:
    """A call multiplying the next matrix of the pool (round-robin) by x, and how many matrices it cycles."""
    if impl == "numpy-f32":
        w32s = workload.f32(residency)
        w32 = itertools.cycle(w32s)
        return (lambda: next(w32) @ x) if x.ndim == 1 else (lambda: x @ next(w32).T), len(w32s)
    count = workload.count(residency)
    if impl == "numpy-q1":
        raw = itertools.cycle(workload.raw[:count])
        return lambda: numpy_q1_matmul(next(raw), workload.rows, workload.cols, x), count
    q1 = itertools.cycle(workload.q1[:count])
    return lambda: next(q1).matmul(x, kernel=impl), count


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", BATCHES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("residency", RESIDENCIES)
def test_matmul(
    benchmark: Any,
    workload: Workload,
    threads: int,
    residency: str,
    n: int,
    impl: str,
    read_bandwidth: Callable[[int], float],
    gemv_means: dict[tuple[Any, ...], float],
) -> None:
    x = np.random.default_rng().standard_normal((n, workload.cols), dtype=np.float32)
    x = x[0] if n == 1 else x
    call, matrices = make_call(workload, impl, residency, x)
    # One lap of the pool first, so no first-call cost is timed: thread pool start, and per matrix the
    # LUT repacking that Q1Matrix builds on first use. numpy-q1 keeps no state; one call will do.
    for _ in range(1 if impl == "numpy-q1" else matrices):
        call()

    benchmark.group = f"{workload.shape} {residency} t{threads} n{n}"
    result = benchmark(call)
    if impl.startswith("numpy") and benchmark.stats is not None:
        settle_blas()
    assert result.shape == ((workload.rows,) if n == 1 else (n, workload.rows))

    benchmark.extra_info.update(
        {"kernel": impl, "residency": residency, "threads": threads, "n": n, "matrices": matrices}
    )
    benchmark.extra_info.update(sizes(workload, impl))
    if benchmark.stats is not None:  # None under --benchmark-disable
        mean = benchmark.stats["mean"]
        benchmark.extra_info.update(speeds(benchmark.extra_info, mean, read_bandwidth(threads)))
        key = (workload.shape, residency, threads, impl)
        if n == 1:
            gemv_means[key] = mean
        if key in gemv_means:  # this kernel's n=1 ran earlier in this session
            benchmark.extra_info["per_row_vs_n1"] = mean / n / gemv_means[key]


def sizes(workload: Workload, impl: str) -> dict[str, Any]:
    q1_bytes = workload.q1[0].nbytes
    return {
        "isa": "numpy" if impl.startswith("numpy") else kernel_info()["isa"],
        "shape": workload.shape,
        "q1_bytes": q1_bytes,
        "read_bytes": 4 * workload.rows * workload.cols if impl == "numpy-f32" else q1_bytes,
    }


def speeds(info: dict[str, Any], mean: float, bandwidth: float) -> dict[str, Any]:
    """Rates from a mean time in seconds; `bandwidth` is the measured read GB/s for the same threads."""
    read_gbs = info["read_bytes"] / mean / 1e9
    return {
        "mean_s": mean,
        "weight_gbs": info["q1_bytes"] / mean / 1e9,
        "read_gbs": read_gbs,
        "read_bandwidth_gbs": bandwidth,
        "pct_bandwidth": 100 * read_gbs / bandwidth,
        "per_row_us": mean / info["n"] * 1e6,
    }


@pytest.mark.parametrize("n", (1, 3))
def test_numpy_q1_baseline_is_right(n: int) -> None:
    """The numpy baseline computes W @ x for the matrix our loader reads from the same bytes (not timed)."""
    rng = np.random.default_rng()
    rows, cols = 300, 384
    raw = random_q1_bytes(rng, rows, cols)
    x = rng.standard_normal((n, cols), dtype=np.float32)
    expected = x @ Q1Matrix.from_bytes(raw, rows, cols).dequantize().T
    np.testing.assert_allclose(numpy_q1_matmul(raw, rows, cols, x), expected, rtol=1e-4, atol=1e-4)

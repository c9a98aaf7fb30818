"""Interleaved A/B timing of the small GEMMs: per-row cost at n against the LUT GEMV at n=1.

pytest-benchmark times each benchmark in one stretch, so on a shared machine a neighbour's load can
land on one kernel and not the other. This script alternates the kernels round by round and keeps each
one's best lap, so all see the same conditions. It prints a markdown table: for every shape and n,
`lut-gemm`, `vnni-gemm` and `perm-gemm` (kernel= names; `gemm` is `perm-gemm` on AVX-512) in µs per
call, their per-row cost over `lut` at n=1, and the speed-up of `perm-gemm` over `vnni-gemm`.

    python benches/gemm_ab.py --threads 1 --residency memory --reps 7
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from baselines import random_q1_bytes

import oxibonsai as ob

SHAPES = ((2048, 2048), (6144, 2048), (2048, 6144))
KERNELS = ("lut-gemm", "vnni-gemm", "perm-gemm")
POOL_BYTES = 128 << 20


def pool(rng: np.random.Generator, rows: int, cols: int, residency: str) -> list[ob.Q1Matrix]:
    """One matrix (cache-resident) or enough distinct ones to exceed every cache (memory-resident)."""
    raw = random_q1_bytes(rng, rows, cols)
    count = 1 if residency == "cache" else max(4, POOL_BYTES // raw.nbytes)
    return [ob.Q1Matrix.from_bytes(raw.copy(), rows, cols) for _ in range(count)]


def best_laps(
    mats: list[ob.Q1Matrix], combos: list[tuple[str, int]], reps: int
) -> dict[tuple[str, int], float]:
    """Seconds per call of each (kernel, n), the best of `reps` laps taken in turn."""
    rng = np.random.default_rng()
    cols = mats[0].cols
    xs = {n: rng.standard_normal((n, cols), dtype=np.float32) for _, n in combos}
    calls = max(1, 32 // len(mats))
    best = dict.fromkeys(combos, float("inf"))
    for m in mats:  # repack every matrix before timing
        m.matmul(xs[combos[0][1]][0])
    for _ in range(reps):
        for kernel, n in combos:
            x = xs[n][0] if n == 1 else xs[n]
            start = time.perf_counter()
            for _ in range(calls):
                for m in mats:
                    m.matmul(x, kernel=kernel)
            best[(kernel, n)] = min(best[(kernel, n)], (time.perf_counter() - start) / (calls * len(mats)))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--residency", choices=("cache", "memory"), default="memory")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--n", type=int, nargs="+", default=[4, 16, 64])
    args = parser.parse_args()
    ob.set_num_threads(args.threads)
    rng = np.random.default_rng()
    info = ob.kernel_info()
    print(f"threads={args.threads}, {args.residency}-resident, best of {args.reps}; gemm={info['gemm']}\n")
    heads = [f"{k} µs" for k in KERNELS] + [f"{k} row/n1" for k in KERNELS] + ["perm/vnni speed-up"]
    print("| shape | n | " + " | ".join(heads) + " |")
    print("|---|--:|" + "--:|" * len(heads))
    for rows, cols in SHAPES:
        combos = [("lut", 1)] + [(k, n) for n in args.n for k in KERNELS]
        best = best_laps(pool(rng, rows, cols, args.residency), combos, args.reps)
        base = best[("lut", 1)]
        for n in args.n:
            secs = [best[(k, n)] for k in KERNELS]
            cells = [f"{t * 1e6:,.1f}" for t in secs] + [f"{t / n / base:.2f}" for t in secs]
            speedup = best[("vnni-gemm", n)] / best[("perm-gemm", n)]
            print(f"| {rows}x{cols} | {n} | " + " | ".join(cells) + f" | {speedup:.2f}x |")
        print(f"| {rows}x{cols} | 1 (lut) | {base * 1e6:,.1f} |" + " |" * (len(heads) - 1))


if __name__ == "__main__":
    main()

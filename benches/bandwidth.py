"""This machine's memory read bandwidth, the ceiling that "% of bandwidth" in the results refers to.

Each thread reduces (`np.max`) its own slice of one large float64 array; numpy releases the GIL inside
the reduction, so two Python threads read in parallel. The array is filled first (never `np.zeros`:
untouched pages all map to one shared zero page and would read from cache). The result is the best of a
few repeats, as STREAM reports it. The same reduction over an L2-sized array is printed as a check that
the reduction itself runs well above the memory rate, i.e. that memory is what is measured.

    python benches/bandwidth.py [--gib 1] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

GIB = 1 << 30


def read_bandwidth_gbs(threads: int, nbytes: int = GIB, repeats: int = 5) -> float:
    """Best-of-`repeats` GB/s (1e9 bytes/s) for `threads` threads reading `nbytes` once between them."""
    data = np.ones(nbytes // 8, dtype=np.float64)
    parts = np.array_split(data, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.max, parts))  # start the threads before timing
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.max, parts))
            best = max(best, data.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def reduction_rate_gbs(nbytes: int = 256 << 10, repeats: int = 200) -> float:
    """The single-thread rate of the same reduction on cache-resident data."""
    data = np.ones(nbytes // 8, dtype=np.float64)
    data.max()
    start = time.perf_counter()
    for _ in range(repeats):
        data.max()
    return nbytes * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="array size in GiB (default 1)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(f"np.max on cache-resident data, 1 thread: {reduction_rate_gbs():.1f} GB/s")
    for threads in args.threads:
        gbs = read_bandwidth_gbs(threads, int(args.gib * GIB))
        print(f"read bandwidth, {threads} thread(s), {args.gib:g} GiB: {gbs:.1f} GB/s")


if __name__ == "__main__":
    main()

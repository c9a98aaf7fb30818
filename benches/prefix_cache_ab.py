"""Interleaved timing of the prefix cache against the pure-Python model: the ratio the issue's target
(>= 20x) is about, robust to a shared machine's load.

`bench_prefix_cache.py` (pytest-benchmark) times each implementation in one stretch, so a neighbour's
burst can land on one side only. This script takes the same operations (`lookup`, `insert`, `evict` of a
chain of 64 to 4,096 blocks, prompts as lists; `rust-numpy` passes a uint32 array) and runs the three
implementations in turn, lap after lap, keeping each one's best time; it prints µs per call and the
speed-up of each Rust form over Python. Each timed call follows an untimed `match` of the same prompt,
so the prompt's objects are as warm as in pytest-benchmark's repeated calls (cold, a 4,096-block list
costs the Rust side several times more: its 65,536 int objects come from memory).

    python benches/prefix_cache_ab.py --laps 30
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from bench_prefix_cache import IMPLS, SIZES, filled, make, prompt


def lookup(impl: str, blocks: int) -> Callable[[], Callable[[], object]]:
    tokens = prompt(impl, blocks)
    cache = filled(impl, blocks, tokens)

    def prepare() -> Callable[[], object]:
        cache.match(tokens)  # warm, like the repeated calls of pytest-benchmark
        return lambda: cache.match(tokens)

    return prepare


def insert(impl: str, blocks: int) -> Callable[[], Callable[[], object]]:
    tokens = prompt(impl, blocks)

    def prepare() -> Callable[[], object]:
        cache = make(impl, blocks)
        held = [cache.allocate() for _ in range(blocks)]
        cache.match(tokens)  # the prompt's objects warm in the caches, as in pytest-benchmark's loop
        return lambda: cache.insert(tokens, held)

    return prepare


def evict(impl: str, blocks: int) -> Callable[[], Callable[[], object]]:
    tokens = prompt(impl, blocks)

    def prepare() -> Callable[[], object]:
        cache = filled(impl, blocks, tokens)
        cache.match(tokens)
        return lambda: cache.evict(blocks)

    return prepare


OPS: dict[str, Callable[[str, int], Callable[[], Callable[[], object]]]] = {
    "lookup": lookup,
    "insert": insert,
    "evict": evict,
}


def best_times(op: str, blocks: int, laps: int) -> dict[str, float]:
    """Best seconds per call of each implementation, the implementations alternating lap by lap."""
    prepares = {impl: OPS[op](impl, blocks) for impl in IMPLS}
    calls = max(1, 2_000 // blocks)
    best = dict.fromkeys(IMPLS, float("inf"))
    for _ in range(laps):
        for impl, prepare in prepares.items():
            for _ in range(calls):
                call: Any = prepare()
                start = time.perf_counter()
                call()
                best[impl] = min(best[impl], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--laps", type=int, default=30)
    parser.add_argument("--ops", nargs="+", choices=tuple(OPS), default=list(OPS))
    args = parser.parse_args()
    print("| op | blocks | python µs | rust µs | rust-numpy µs | rust speed-up | rust-numpy speed-up |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for op in args.ops:
        for blocks in SIZES:
            t = best_times(op, blocks, args.laps)
            py, rs, rn = (t[i] * 1e6 for i in ("python", "rust", "rust-numpy"))
            print(
                f"| {op} | {blocks} | {py:,.1f} | {rs:,.1f} | {rn:,.1f} | {py / rs:.1f}x | {py / rn:.1f}x |"
            )


if __name__ == "__main__":
    main()

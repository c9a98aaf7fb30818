"""How long ``AsyncLLM`` stalls the event loop that submits to it: 32 requests of 64 random prompt
tokens and 48 greedy output tokens arrive over 2 s on the Bonsai-1.7B-shaped random model (16 running
at once), while a ticker task sleeps 5 ms at a time and records how late it wakes. Prints the time
each ``generate()`` call took and the ticker's lateness (p50/p90/p99/max, ms). Before the inbox,
``generate()`` waited for the running step (worst 1.8 s); it should now never wait for one.

    python benches/async_stall.py [--threads 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

from bench_model import untied_model_path

import oxibonsai as ob

TICK_S = 0.005


def percentiles_ms(values: list[float], qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[float]:
    ordered = sorted(values)
    picked = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs]
    return [round(x * 1e3, 1) for x in [*picked, ordered[-1]]]


async def measure(path: Path, threads: int) -> tuple[list[float], list[float], float]:
    engine = ob.AsyncLLM(str(path), num_threads=threads, max_num_seqs=16, max_model_len=1024)
    params = ob.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    lateness: list[float] = []
    submit: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            start = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lateness.append(time.perf_counter() - start - TICK_S)

    async def one() -> None:
        await asyncio.sleep(random.random() * 2)
        ids = [random.randrange(1000, 100000) for _ in range(64)]
        start = time.perf_counter()
        stream = engine.generate({"prompt_token_ids": ids}, params)
        submit.append(time.perf_counter() - start)
        async for _ in stream:
            pass

    tick = asyncio.ensure_future(ticker())
    start = time.perf_counter()
    try:
        await asyncio.gather(*(one() for _ in range(32)))
    finally:
        done = True
        await tick
        engine.shutdown()
    return submit, lateness, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=Path, default=None)
    args = p.parse_args()
    submit, lateness, wall = asyncio.run(measure(untied_model_path(args.model), args.threads))
    print(f"wall {wall:.1f} s")
    print("generate() ms p50/p90/p99/max", percentiles_ms(submit))
    print("loop lateness ms p50/p90/p99/max", percentiles_ms(lateness))


if __name__ == "__main__":
    main()

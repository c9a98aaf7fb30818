"""How long a running request waits while ``AsyncLLM.embed`` embeds a long prompt beside it. One greedy
request of 32 random prompt tokens decodes 64 tokens on the Bonsai-1.7B-shaped random model; once it
has 8, a ``--embed-len``-token prompt is embedded. Prints, per way of embedding, the embedding's time
and the request's longest gap between two tokens while the embedding ran (and its median gap then):

- ``whole``: the whole prefill under the engine lock between two steps (what ``AsyncLLM.embed`` did
  before its loop jobs, ``async_jobs``; run here as that code ran, ``LLM.embed`` inside
  ``AsyncLLM._control``);
- ``chunked``: ``AsyncLLM.embed`` now, ``max_num_batched_tokens`` tokens after each engine step.

The two alternate for ``--rounds`` rounds on one engine; the best round of each is kept.

    python benches/bench_embed_stall.py [--rounds 3] [--threads 2] [--embed-len 1024] [--model PATH]
        [--max-num-batched-tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench_model import machine_lines, untied_model_path

import oxibonsai as ob

WAYS = ("whole", "chunked")


async def embed_whole(engine: ob.AsyncLLM, ids: list[int]) -> Any:
    def locked() -> Any:
        with engine._control():
            return engine._llm.embed([ids])

    return await asyncio.to_thread(locked)


async def one_round(engine: ob.AsyncLLM, way: str, embed_len: int) -> tuple[float, float, float]:
    """The embedding's seconds, and the request's longest and median gaps (s) while it ran."""
    params = ob.SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompt = [random.randrange(1000, 100000) for _ in range(32)]
    embed_ids = [random.randrange(1000, 100000) for _ in range(embed_len)]
    arrivals: list[float] = []
    window: list[float] = []

    async def embed() -> None:
        start = time.perf_counter()
        await (embed_whole(engine, embed_ids) if way == "whole" else engine.embed([embed_ids]))
        window.extend([start, time.perf_counter()])

    task = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params):
        arrivals.append(time.perf_counter())
        if len(out.outputs[0].token_ids) == 8 and task is None:
            task = asyncio.ensure_future(embed())
    assert task is not None
    await task
    start, end = window
    # Gaps that overlap the embedding: from the last token before its start to the first after its end.
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b > start and a < end]
    if not gaps:  # the request finished before the embedding did
        gaps = [end - arrivals[-1]]
    return end - start, max(gaps), statistics.median(gaps)


async def measure(
    path: Path, threads: int, rounds: int, embed_len: int, budget: int | None
) -> dict[str, tuple[float, ...]]:
    engine = ob.AsyncLLM(
        str(path), num_threads=threads, max_model_len=embed_len + 128, max_num_batched_tokens=budget
    )
    best: dict[str, tuple[float, ...]] = {}
    try:
        await one_round(engine, "chunked", 64)  # warm-up
        for _ in range(rounds):
            for way in WAYS:
                got = await one_round(engine, way, embed_len)
                print(way, [round(x * 1e3, 1) for x in got], flush=True)
                if way not in best or got[1] < best[way][1]:
                    best[way] = got
    finally:
        engine.shutdown()
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--embed-len", type=int, default=1024)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the chunk (default 256)")
    args = p.parse_args()
    for line in machine_lines():
        print(line)
    path = untied_model_path(args.model)
    best = asyncio.run(measure(path, args.threads, args.rounds, args.embed_len, args.max_num_batched_tokens))
    print("| embedding | embed ms | longest gap ms | median gap ms |")
    print("|---|--:|--:|--:|")
    for way in WAYS:
        took, longest, median = (x * 1e3 for x in best[way])
        print(f"| {way} | {took:,.1f} | {longest:,.1f} | {median:,.1f} |")


if __name__ == "__main__":
    main()

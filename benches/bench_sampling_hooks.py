"""What the per-request hooks of session 38 cost end to end, on one prompt of 64 random tokens and 32
generated ones (Bonsai-1.7B-shaped random model, 2 threads, the prompt from the prefix cache after the
first round): plain greedy decoding; greedy with a no-op logits processor (a copy of each 151,936-wide
row and a Python call); with a thinking budget (counting only, and only where the vocabulary has
``<think>``: the random file's has not); and beam search at widths 1 and 4: on forked KV sequences
(``LLM.beam_search``), the same run by ``AsyncLLM``'s step loop between engine steps
(``AsyncLLM.beam_search``, the server's ``use_beam_search``), and as concurrent one-token requests of
the ``AsyncLLM`` over the prefix cache (``AsyncEngineBeams``: the torch runner's and a remote
engine's form). Prints the median over ``--rounds`` of each form's generated tokens per second, the
forms alternated per round.

    python benches/bench_sampling_hooks.py [--rounds 5] [--threads 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench_model import machine_lines, untied_model_path

import oxibonsai as ob
from oxibonsai.async_beam_search import AsyncEngineBeams
from oxibonsai.beam_search import BeamSearch

TOKENS = 32


def forms(llm: ob.LLM, engine: ob.AsyncLLM, prompt: list[int]) -> dict[str, Callable[[], object]]:
    greedy = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}

    def no_op(output_ids: list[int], logits: object) -> None:
        return None

    def generate(**more: object) -> Callable[[], object]:
        return lambda: llm.generate([prompt], ob.SamplingParams(**greedy, **more), use_tqdm=False)  # type: ignore[arg-type]

    def beams(width: int) -> Callable[[], object]:
        params = ob.BeamSearchParams(beam_width=width, max_tokens=TOKENS, ignore_eos=True)
        return lambda: llm.beam_search([prompt], params)

    runs = {"plain": generate(), "logits processor (no-op)": generate(logits_processors=[no_op])}
    if llm.tokenizer.token_to_id("</think>") is not None:  # the random file's vocabulary has none
        runs["thinking budget"] = generate(thinking_token_budget=8)

    def async_beams(width: int) -> Callable[[], object]:
        params = ob.BeamSearchParams(beam_width=width, max_tokens=TOKENS, ignore_eos=True)
        return lambda: asyncio.run(engine.beam_search([prompt], params))

    def request_beams(width: int) -> Callable[[], object]:
        params = ob.BeamSearchParams(beam_width=width, max_tokens=TOKENS, ignore_eos=True)
        stop, decode = set(llm.tokenizer.stop_token_ids), llm.tokenizer.decode

        async def search() -> object:
            state = BeamSearch([prompt], params, stop, decode)
            await AsyncEngineBeams(engine.generate, state, [None]).run()
            return state.outputs()

        return lambda: asyncio.run(search())

    for width in (1, 4):
        runs[f"beam search, width {width}"] = beams(width)
        runs[f"AsyncLLM beam search, width {width}"] = async_beams(width)
        runs[f"one-token requests, width {width}"] = request_beams(width)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=Path, default=None)
    args = p.parse_args()
    for line in machine_lines():
        print(line)
    path = str(untied_model_path(args.model))
    llm = ob.LLM(path, num_threads=args.threads, max_model_len=512)
    engine = ob.AsyncLLM(path, num_threads=args.threads, max_model_len=512)  # idle between its runs
    prompt = [random.randrange(0, llm.config["vocab"]) for _ in range(64)]
    runs = forms(llm, engine, prompt)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds + 1):  # the first round warms the cache and is dropped
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            rates[name].append(TOKENS / (time.perf_counter() - start))
    print("| form | generated tokens/s (median) | / plain |")
    print("|---|--:|--:|")
    plain = statistics.median(rates["plain"][1:])
    for name, values in rates.items():
        rate = statistics.median(values[1:])
        print(f"| {name} | {rate:.1f} | {rate / plain:.3f} |")
    engine.shutdown()


if __name__ == "__main__":
    main()

"""Speculative decoding with n-gram drafts (``speculative_config``), on the native runner.

- Row cost: one sequence's step computing its token and k drafts (k = 0, 1, 2, 4, 8) at --context
  tokens of context, on the Bonsai-1.7B-shaped random model of ``bench_model.py``: the median step
  time as a multiple of k = 0's, which is what a drafted token costs (``spec::acceptance::ROW_COST``).
- Decode speed, one request at a time: tokens/s from the first token to the last without
  speculation, with adaptive drafting (the default) and with fixed drafts (``adaptive: false``, as
  vLLM drafts), in interleaved rounds; with the share of drafts kept and the tokens per decode step.
  Workloads: ``repeat`` (a phrase said three times, greedy: the output repeats what the prompt holds),
  ``greedy`` (a random prompt, greedy: the random model falls into loops) and ``sampled`` (a random
  prompt at temperature 1.0: drafts are nearly never right, so this is their cost) on the random
  model; ``repeat`` and ``docs`` (a prose prompt) on the embedded default model, whose steps are
  short enough that the engine's own work shows.
Prints the machine and command first.

    python benches/bench_speculative.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from bench_model import machine_lines, untied_model_path, vocab_size

import oxibonsai as ob

MODES = {
    "off": None,
    "adaptive": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    },
    "fixed": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
        "adaptive": False,
    },
}
DOCS = "The os module provides a portable way of using operating system dependent functionality."


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=256, help="of the row-cost steps")
    p.add_argument("--decode", type=int, default=64, help="tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="a GGUF instead of the random Bonsai-1.7B-shaped one")
    p.add_argument("--skip-row-cost", action="store_true")
    return p.parse_args()


def row_cost(path: Path, threads: int, context: int, rounds: int, rng: np.random.Generator) -> None:
    llm = ob.LLM(str(path), num_threads=threads, max_model_len=context + 64 * rounds * 8)
    model = llm._runner._model  # the native model: steps of chosen sizes, no engine
    vocab = int(model.vocab_size)
    seq = model.add_sequence()
    model.step([(seq, [int(t) for t in rng.integers(0, vocab, context)], "none")])
    times: dict[int, list[float]] = {k: [] for k in (0, 1, 2, 4, 8)}
    for _ in range(rounds * 3):
        for k in times:
            tokens = [int(t) for t in rng.integers(0, vocab, k + 1)]
            start = time.perf_counter()
            model.step([(seq, tokens, "all")])
            times[k].append(time.perf_counter() - start)
    base = statistics.median(times[0])
    print(f"\nRow cost at {context} tokens of context ({threads} threads), median of {rounds * 3} steps:")
    print("| drafts | step ms | vs none | per draft |")
    print("|--:|--:|--:|--:|")
    for k, ts in times.items():
        m = statistics.median(ts)
        per = f"{(m / base - 1) / k:.2f}" if k else "-"
        print(f"| {k} | {m * 1e3:.1f} | {m / base:.2f}x | {per} |")


def workloads(random_path: Path, rng: np.random.Generator) -> list[tuple[str, str | None, object, dict]]:
    vocab = vocab_size(random_path)
    phrase = [int(t) for t in rng.integers(0, vocab, 40)]
    words = "the file open returns a list of value module string".split()
    text = " ".join(rng.choice(words, 12))
    greedy = {"temperature": 0.0}
    return [
        ("random 1.7B: repeat", str(random_path), phrase * 3 + phrase[:4], greedy),
        ("random 1.7B: greedy", str(random_path), [int(t) for t in rng.integers(0, vocab, 64)], greedy),
        (
            "random 1.7B: sampled",
            str(random_path),
            [int(t) for t in rng.integers(0, vocab, 64)],
            {"temperature": 1.0},
        ),
        ("embedded: repeat", None, f"{text}\n{text}\n{text}\n{text.split()[0]}", greedy),
        ("embedded: docs", None, DOCS, greedy),
    ]


def decode_speed(args: argparse.Namespace, random_path: Path, rng: np.random.Generator) -> None:
    print(
        f"\nDecode, one request, {args.decode} tokens, tokens/s first token to last "
        f"(median of {args.rounds}):"
    )
    print("| workload | off | adaptive | vs off | kept | tokens/step | fixed | vs off | kept | tokens/step |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, path, prompt, sampling in workloads(random_path, rng):
        llms = {
            mode: ob.LLM(
                path,
                num_threads=args.threads,
                max_model_len=1024 if path else None,
                speculative_config=config,
            )
            for mode, config in MODES.items()
        }
        speeds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for llm in llms.values():
            llm.generate([prompt], ob.SamplingParams(max_tokens=4, ignore_eos=True, **sampling))
        counters0 = {mode: llm.metrics()["counters"] for mode, llm in llms.items()}
        steps0 = {mode: llm._engine.scheduler_stats()["steps"] for mode, llm in llms.items()}
        for r in range(args.rounds):
            for mode, llm in llms.items():
                params = ob.SamplingParams(
                    max_tokens=args.decode, ignore_eos=True, seed=args.seed + r, **sampling
                )
                out = llm.generate([prompt], params)[0]
                m = out.metrics
                speeds[mode].append((args.decode - 1) / (m.finished_time - m.first_token_time))
        cells = [f"{statistics.median(speeds['off']):.1f}"]
        base = statistics.median(speeds["off"])
        for mode in ("adaptive", "fixed"):
            c, c0 = llms[mode].metrics()["counters"], counters0[mode]
            drafted = c["spec_decode_num_draft_tokens_total"] - c0["spec_decode_num_draft_tokens_total"]
            kept = c["spec_decode_num_accepted_tokens_total"] - c0["spec_decode_num_accepted_tokens_total"]
            steps = llms[mode]._engine.scheduler_stats()["steps"] - steps0[mode]
            decode_steps = steps - args.rounds  # each request's first step computes its prompt
            per_step = (args.decode - 1) * args.rounds / max(decode_steps, 1)
            v = statistics.median(speeds[mode])
            share = f"{kept}/{drafted}" if drafted else "-"
            cells += [f"{v:.1f}", f"{v / base:.2f}x", share, f"{per_step:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    args = parse_args()
    print("\n".join(machine_lines()))
    print("command: python " + " ".join(sys.argv))
    rng = np.random.default_rng(args.seed)
    path = untied_model_path(args.model)
    ob.set_num_threads(args.threads)
    if not args.skip_row_cost:
        row_cost(path, args.threads, args.context, args.rounds, rng)
    decode_speed(args, path, rng)


if __name__ == "__main__":
    main()

"""What a step of k new tokens of one sequence costs against a step of one (the question behind
speculative decoding: verifying k - 1 drafted tokens is one k-token step). A sequence is prefilled with
``--context`` random tokens, then steps of k random tokens run on it (``--steps`` per k, median kept),
for k = 1, 2, 4, 8, 16, each step returning the logits of every new row (what a verification needs)
and, for comparison, of the last row only; best median over ``--rounds`` rounds.

    python benches/bench_step_tokens.py [--rounds 3] [--threads N] [--model PATH] [--context 256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import oxibonsai as ob

SIZES = (1, 2, 4, 8, 16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    if args.threads is not None:
        ob.set_num_threads(args.threads)
    llm = ob.LLM(args.model, max_model_len=args.context + args.steps * max(SIZES) + 16)
    model = llm._runner._model  # the native model: steps on a sequence of our own, no scheduler
    vocab = llm.config["vocab"]
    rng = np.random.default_rng()
    print(f"vocab {vocab}; context {args.context}; kernels {ob.kernel_info()}")
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for rows in ("all", "last"):
            for k in SIZES:
                seq = model.add_sequence()
                model.step([(seq, [int(t) for t in rng.integers(0, vocab, args.context)], "last")])
                times = []
                for _ in range(args.steps):
                    tokens = [int(t) for t in rng.integers(0, vocab, k)]
                    start = time.perf_counter()
                    model.step([(seq, tokens, rows)])
                    times.append(time.perf_counter() - start)
                model.free_sequence(seq)
                key = (rows, k)
                best[key] = min(best.get(key, np.inf), float(np.median(times)))
    for rows in ("all", "last"):
        one = best[(rows, 1)]
        cells = ", ".join(f"k={k} {1e3 * best[(rows, k)]:.2f} ms ({best[(rows, k)] / one:.2f}x)"
                          for k in SIZES)  # fmt: skip
        print(f"logits of {rows} rows: {cells}")


if __name__ == "__main__":
    main()

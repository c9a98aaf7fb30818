"""What an embedding costs next to a one-token generation of the same prompt: ``LLM.embed`` (one
prefill without the LM head, last-token pooling) against ``LLM.generate(max_tokens=1)`` (one prefill
with the LM head on its last row, one draw), for random prompts of ``--tokens`` ids, prefix cache off,
the two alternated over ``--rounds`` rounds; prints the median and best wall time of each.

    python benches/bench_embed.py [--rounds 5] [--threads N] [--model PATH] [--tokens 128]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import oxibonsai as ob


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    if args.threads is not None:
        ob.set_num_threads(args.threads)
    llm = ob.LLM(args.model, max_model_len=max(512, args.tokens + 8), enable_prefix_caching=False)
    vocab = llm.config["vocab"]
    print(f"vocab {vocab}; hidden {llm.config['hidden']}; {args.tokens} tokens; kernels {ob.kernel_info()}")
    rng = np.random.default_rng()
    runs = {
        "embed": lambda ids: llm.embed([ids]),
        "generate 1 token": lambda ids: llm.generate([ids], ob.SamplingParams(max_tokens=1, temperature=0)),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        ids = [int(t) for t in rng.integers(0, vocab, args.tokens)]
        for name, run in runs.items():
            start = time.perf_counter()
            run(ids)
            times[name].append(time.perf_counter() - start)
    base = float(np.median(times["generate 1 token"]))
    for name, t in times.items():
        med = float(np.median(t))
        print(f"{name:18s} median {1e3 * med:7.1f} ms  best {1e3 * min(t):7.1f} ms  {med / base:.2f}x")


if __name__ == "__main__":
    main()

"""The cost of prompt logprobs: one 500-token prompt on the embedded model (context 512, vocab 4,096)
or ``--model PATH``, prefilled with one generated token, plain and with ``prompt_logprobs`` 0 and 5,
alternated over ``--rounds`` rounds; prints the median and best wall time of each. A scored prompt
runs the LM head on every position instead of the last, then scores each row in Rust.

    python benches/bench_prompt_logprobs.py [--rounds 5] [--threads N] [--model PATH]
"""

from __future__ import annotations

import time

import numpy as np

import oxibonsai as ob

from bench_args import parse


def main() -> None:
    args = parse(model=True)
    rounds = args.rounds
    llm = ob.LLM(args.model, max_model_len=512, enable_prefix_caching=False)
    vocab = llm.config["vocab"]
    print(f"vocab {vocab}; kernels {ob.kernel_info()}")
    ids = [int(t) for t in np.random.default_rng().integers(0, vocab, 500)]
    params = {
        "plain": ob.SamplingParams(max_tokens=1, temperature=0),
        "prompt_logprobs=0": ob.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
        "prompt_logprobs=5": ob.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5),
    }
    times: dict[str, list[float]] = {name: [] for name in params}
    for _ in range(rounds):
        for name, p in params.items():
            start = time.perf_counter()
            llm.generate([ids], p)
            times[name].append(time.perf_counter() - start)
    base = float(np.median(times["plain"]))
    for name, t in times.items():
        med = float(np.median(t))
        print(f"{name:18s} median {1e3 * med:7.1f} ms  best {1e3 * min(t):7.1f} ms  {med / base:.2f}x plain")


if __name__ == "__main__":
    main()

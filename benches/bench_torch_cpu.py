"""The cost of the runner seam on the CPU: the same engine (``LLM.generate``, greedy) over the native
Rust runner and over the torch runner on torch's CPU device (plain-torch reference ops, which
dequantize Q1 weights on every matmul: the test oracle and the MPS fallback, not a fast path), in
alternating rounds. Prefill is one prompt of ``--prompt`` tokens with one output token; decode is
``--decode`` tokens after it, for 1 and ``--batch`` concurrent requests. Not a race to win: the torch
runner exists for GPUs; this says what running it on the CPU costs.

    python benches/bench_torch_cpu.py [--model PATH] [--threads 2] [--rounds 3]

Without ``--model`` it uses the embedded default model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import oxibonsai as ob


def prompts(rng: np.random.Generator, vocab: int, n: int, length: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(n)]


def timed(llm: ob.LLM, batch: list[list[int]], max_tokens: int) -> float:
    params = ob.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(batch, params)
    return time.perf_counter() - start


def measure(llm: ob.LLM, rng: np.random.Generator, args: argparse.Namespace) -> dict[str, float]:
    """tokens/s: prefill of one prompt, decode of 1 and of ``batch`` requests (prefill time excluded)."""
    vocab = llm.config["vocab"]
    llm.reset_prefix_cache()
    prefill = timed(llm, prompts(rng, vocab, 1, args.prompt), 1)
    out = {"prefill": args.prompt / prefill}
    for n in (1, args.batch):
        batch = prompts(rng, vocab, n, 16)
        timed(llm, batch, 1)  # caches the prompts: both timed runs below start on them
        base = timed(llm, batch, 1)
        total = timed(llm, batch, args.decode + 1)
        out[f"decode_x{n}"] = n * args.decode / max(total - base, 1e-9)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    ob.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    common = {"max_model_len": 512, "max_num_seqs": args.batch, "kv_cache_dtype": "f16"}
    runners = {
        "native": ob.LLM(args.model, runner="native", **common),
        "torch-cpu": ob.LLM(args.model, device="cpu", runner="torch", **common),
    }
    rng = np.random.default_rng(0)
    for llm in runners.values():
        measure(llm, rng, argparse.Namespace(**{**vars(args), "prompt": 16, "decode": 2}))  # warm-up
    results: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, llm in runners.items():
            results[name].append(measure(llm, rng, args))
    keys = list(results["native"][0])
    print(f"threads {args.threads}, {args.rounds} alternating rounds, medians (tokens/s)")
    print("| measure | native | torch-cpu | torch / native |\n|---|--:|--:|--:|")
    for key in keys:
        native = statistics.median(r[key] for r in results["native"])
        ours = statistics.median(r[key] for r in results["torch-cpu"])
        print(f"| {key} | {native:.1f} | {ours:.1f} | {ours / native:.3f} |")


if __name__ == "__main__":
    main()

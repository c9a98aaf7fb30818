"""What the int8 KV cache buys: the same file (default: the random Bonsai-1.7B-shaped GGUF of
``bench_model.py``) loaded with ``kv_cache_dtype="f16"`` and ``"int8"``; for each ``--contexts`` length
a random prompt of that many ids is prefilled once into each engine's prefix cache (that prefill's
tokens/s is printed), then ``--decode`` greedy tokens are decoded after it ``--rounds`` times, the two
dtypes alternated, the prompt served from the cache each time. Prints KV bytes per token, each dtype's
median decode tokens/s and the int8 / f16 ratio within each round (median, min, max).

    python benches/bench_kv_int8.py [--model PATH] [--rounds 5] [--threads N]
                                    [--contexts 512 2048 4096] [--decode 32]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from bench_model import machine_lines, untied_model_path

import oxibonsai as ob

DTYPES = ("f16", "int8")


def engine(model: Path, dtype: str, length: int) -> ob.LLM:
    return ob.LLM(model, kv_cache_dtype=dtype, max_model_len=length, max_num_seqs=1)


def bytes_per_token(llm: ob.LLM) -> float:
    stats = llm.cache_stats()
    return stats["capacity_bytes"] / stats["capacity_blocks"] / llm.block_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args()
    if args.threads is not None:
        ob.set_num_threads(args.threads)
    model = untied_model_path(Path(args.model) if args.model else None)
    print("\n".join(machine_lines()))
    print(f"{model.name}: decode {args.decode}, threads {ob.get_num_threads()}, {ob.kernel_info()}")
    params = ob.SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng()
    for context in args.contexts:
        length = context + args.decode + 16
        llms = {dtype: engine(model, dtype, length) for dtype in DTYPES}
        ids = [int(t) for t in rng.integers(0, llms["f16"].config["vocab"], context)]
        line = [f"context {context:5d}:"]
        for dtype, llm in llms.items():
            m = llm.generate([ids], ob.SamplingParams(max_tokens=1))[0].metrics
            prefill = context / m.time_to_first_token
            line.append(f"{dtype} {bytes_per_token(llm) / 1024:.1f} KiB/token, prefill {prefill:.1f} tok/s;")
        print(" ".join(line))
        speeds: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        for _ in range(args.rounds):
            for dtype, llm in llms.items():
                out = llm.generate([ids], params)[0]
                assert out.num_cached_tokens >= context - 16
                speeds[dtype].append(out.metrics.decode_tokens_per_s)
        half, int8 = np.array(speeds["f16"]), np.array(speeds["int8"])
        r = int8 / half
        print(
            f"  decode f16 {np.median(half):7.1f} tok/s  int8 {np.median(int8):7.1f} tok/s  "
            f"int8/f16 median {np.median(r):.3f} (min {r.min():.3f}, max {r.max():.3f})"
        )


if __name__ == "__main__":
    main()

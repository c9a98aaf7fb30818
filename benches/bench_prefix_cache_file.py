"""What a prefix-cache file buys a restarted engine: a ``--system``-token system prompt plus a short
tail, on the random Bonsai-1.7B-shaped GGUF of ``bench_model.py`` (or ``--model``). Each round: a fresh
engine's cold time to first token (TTFT); that engine saves its cache (time, file size); a second fresh
engine loads it (time) and answers a new tail behind the same system prompt (TTFT). Prints the medians
and the warm/cold TTFT ratio per round (median, min, max).

    python benches/bench_prefix_cache_file.py [--model PATH] [--system 1024] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_model import machine_lines, untied_model_path

import oxibonsai as ob


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads is not None:
        ob.set_num_threads(args.threads)
    model = untied_model_path(Path(args.model) if args.model else None)
    print("\n".join(machine_lines()))
    length = args.system + args.tail + 8
    params = ob.SamplingParams(max_tokens=1, temperature=0.0)
    rng = np.random.default_rng()
    rows: dict[str, list[float]] = {"cold": [], "warm": [], "save": [], "load": [], "mib": []}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cache.bin"
        for _ in range(args.rounds):
            vocab = ob.LLM(model, max_model_len=64).config["vocab"]
            system = [int(t) for t in rng.integers(0, vocab, args.system)]
            tails = [[int(t) for t in rng.integers(0, vocab, args.tail)] for _ in range(2)]
            first = ob.LLM(model, max_model_len=length, max_num_seqs=1)
            rows["cold"].append(first.generate([system + tails[0]], params)[0].metrics.time_to_first_token)
            start = time.perf_counter()
            first.save_prefix_cache(path)
            rows["save"].append(time.perf_counter() - start)
            rows["mib"].append(path.stat().st_size / 2**20)
            del first
            second = ob.LLM(model, max_model_len=length, max_num_seqs=1)
            start = time.perf_counter()
            second.load_prefix_cache(path)
            rows["load"].append(time.perf_counter() - start)
            out = second.generate([system + tails[1]], params)[0]
            rows["warm"].append(out.metrics.time_to_first_token)
            print(f"  round: cached {out.num_cached_tokens} of {len(out.prompt_token_ids)} prompt tokens")
    med = {k: float(np.median(v)) for k, v in rows.items()}
    ratio = np.array(rows["warm"]) / np.array(rows["cold"])
    shape = f"system {args.system} + tail {args.tail} tokens"
    print(f"{Path(model).name}: {shape}, threads {ob.get_num_threads()}")
    print(f"cold TTFT {1e3 * med['cold']:8.1f} ms   warm TTFT after load {1e3 * med['warm']:8.1f} ms")
    print(f"warm/cold median {np.median(ratio):.3f} (min {ratio.min():.3f}, max {ratio.max():.3f})")
    print(f"save {1e3 * med['save']:.1f} ms, load {1e3 * med['load']:.1f} ms, file {med['mib']:.1f} MiB")


if __name__ == "__main__":
    main()

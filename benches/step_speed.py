"""Bare native step speed: prefill and decode through ``_core.Model.step`` alone, without the Python
engine (no sampling, detokenization or output objects), at a short and a long context. The gap to
``bench_model.py``'s engine figures is the per-token Python cost. Also the workload to profile:

    python benches/step_speed.py [--model PATH] [--threads 1 2] [--contexts 8 512] [--steps 12]
    perf record -g python benches/step_speed.py --threads 2 --contexts 512 --steps 150

Without ``--model`` it uses the Bonsai-1.7B-shaped file ``bench_model.py --keep`` leaves in /tmp.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from oxibonsai import _core

DEFAULT_MODEL = "/tmp/oxibonsai-bench/bonsai-1.7b-random-untied-v1.gguf"


def measure(model: _core.Model, context: int, steps: int, rng: np.random.Generator) -> tuple[float, float]:
    """(prefill tokens/s of a `context`-token prompt, decode tokens/s of `steps` tokens after it)."""
    prompt = [int(t) for t in rng.integers(0, model.vocab_size, context)]
    seq = model.add_sequence()
    try:
        start = time.perf_counter()
        model.step([(seq, prompt, "last")])
        prefill = context / (time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(steps):
            model.step([(seq, [int(rng.integers(0, model.vocab_size))], "last")])
        return prefill, steps / (time.perf_counter() - start)
    finally:
        model.free_sequence(seq)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8, 512])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    model = _core.Model(args.model, max_model_len=None, kv_cache_dtype=args.kv_cache_dtype)
    if max(args.contexts) + args.steps > model.max_model_len:
        parser.error(f"--contexts plus --steps must fit the model's context ({model.max_model_len})")
    rng = np.random.default_rng()
    measure(model, 8, 2, rng)  # warm-up: packs the LUT weights, touches the pages
    print("| threads | context | prefill tok/s | decode tok/s |\n|--:|--:|--:|--:|")
    for threads in args.threads:
        _core.set_num_threads(threads)
        for context in args.contexts:
            prefill, decode = measure(model, context, args.steps, rng)
            print(f"| {threads} | {context} | {prefill:.1f} | {decode:.1f} |")


if __name__ == "__main__":
    main()

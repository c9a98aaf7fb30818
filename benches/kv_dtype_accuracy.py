"""What each KV cache dtype costs in accuracy: the embedded default model's bits per byte on its
held-out text (every evaluation window, as ``tests/test_default_model.py`` scores them) with f32, f16
and int8 KV; then, on ``--models`` random tiny models (tied and untied, ``tests/models.py``), the
largest logit error of a ``--tokens``-token random prompt against the float64 numpy reference
(``kernel="reference"``, so only the KV cache rounds).

    python benches/kv_dtype_accuracy.py [--models 6] [--tokens 60]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

import oxibonsai as ob

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from heldout import bits_per_byte, heldout_stream
from models import write_tiny
from qwen3_reference import ReferenceQwen3

DTYPES = ("f32", "f16", "int8")


def held_out_bits_per_byte() -> None:
    for dtype in DTYPES:
        llm = ob.LLM(kv_cache_dtype=dtype)
        window, count = (
            int(llm.metadata["oxibonsai.eval.window_tokens"]),
            int(llm.metadata["oxibonsai.eval.windows"]),
        )
        bpb = bits_per_byte(llm, heldout_stream(llm), window, count)
        print(f"embedded model, {dtype:4s} KV: {bpb:.7f} bits per byte ({count} windows of {window})")


def tiny_model_errors(models: int, tokens: int) -> None:
    errors: dict[str, list[float]] = {dtype: [] for dtype in DTYPES[1:]}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(models):
            for tied in (True, False):
                path = write_tiny(Path(tmp) / f"m{seed}{tied}.gguf", seed * 7 + 3, tied=tied)
                reference = ReferenceQwen3.from_gguf(path)
                ids = None
                for dtype in errors:
                    llm = ob.LLM(path, kernel="reference", kv_cache_dtype=dtype)
                    if ids is None:
                        rng = np.random.default_rng(seed)
                        ids = [int(t) for t in rng.integers(0, llm.config["vocab"], tokens)]
                    errors[dtype].append(float(np.abs(llm.logits(ids) - reference.logits(ids)).max()))
    for dtype, e in errors.items():
        print(f"{len(e)} tiny models, {dtype:4s} KV: largest logit error {min(e):.4f}-{max(e):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=60)
    args = ap.parse_args()
    held_out_bits_per_byte()
    tiny_model_errors(args.models, args.tokens)


if __name__ == "__main__":
    main()

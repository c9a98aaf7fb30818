"""Session-wide tiny Qwen3 GGUF files for the model, generation and CLI tests: random Q1_0 weights in
the real tensor layout, with a trained byte-level BPE vocabulary and a Qwen3-style chat template."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

from model_factory import TinyQwen3Config, write_qwen3_gguf
from tokenizer_fixture import make_tokenizer_metadata


@cache
def tokenizer_meta() -> dict:
    return make_tokenizer_metadata(800)


def tiny_config(**overrides: object) -> TinyQwen3Config:
    vocab = len(tokenizer_meta()["tokenizer.ggml.tokens"])
    return TinyQwen3Config(vocab_size=vocab, **overrides)  # type: ignore[arg-type]


def write_tiny(path: Path, seed: int, *, tied: bool = True, **kwargs: object) -> Path:
    cfg = kwargs.pop("cfg", None) or tiny_config()
    write_qwen3_gguf(
        path, cfg, np.random.default_rng(seed), tied=tied, tokenizer_meta=tokenizer_meta(), **kwargs
    )
    return path

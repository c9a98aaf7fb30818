"""Embeddings: a prompt's final hidden states (after the model's last RMSNorm, what the LM head reads)
pooled into one vector, as llama.cpp and vLLM make them from a decoder model.

Pooling is ``"last"`` (the last token's state: Qwen3-Embedding's, whose GGUF appends the EOS token
when tokenizing), ``"mean"`` (the average over the prompt's tokens) or ``"cls"`` (the first token's).
A model names its own in the GGUF's ``{arch}.pooling_type`` (llama.cpp's numbering: 1 mean, 2 cls,
3 last); without one it is ``"last"``. The vector is L2-normalized unless ``normalize=False``.
This module only pools; the hidden states come from the runner."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

POOLINGS = ("last", "mean", "cls")
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def model_pooling(metadata: Mapping[str, Any]) -> str:
    """The pooling the GGUF names (``{arch}.pooling_type``), else ``"last"``."""
    arch = metadata.get("general.architecture")
    return _GGUF_POOLING.get(int(metadata.get(f"{arch}.pooling_type", 3)), "last")


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
    return pooling


def pooled(hidden: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """One float32 vector from ``hidden`` (``tokens x width``), in float64 until the end."""
    rows = hidden.astype(np.float64)
    if pooling == "last":
        vector = rows[-1]
    elif pooling == "cls":
        vector = rows[0]
    else:
        vector = rows.mean(axis=0)
    if normalize:
        norm = np.linalg.norm(vector)
        vector = vector / norm if norm > 0 else vector
    return vector.astype(np.float32)

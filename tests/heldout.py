"""Bits per byte of a model on the embedded default model's held-out text (documents the training
never saw, in ``data/default_model_heldout.txt``), through ``LLM.logits``, exactly as
``scripts/default_model/evaluate.py`` computes them in torch."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

import oxibonsai as ob

HELDOUT = Path(__file__).parent / "data" / "default_model_heldout.txt"
ENDOFTEXT = "<|endoftext|>"


def heldout_stream(llm: ob.LLM) -> np.ndarray:
    tokenizer = llm.tokenizer
    eot = tokenizer.encode(ENDOFTEXT, add_special_tokens=False)
    assert len(eot) == 1
    ids: list[int] = []
    for doc in HELDOUT.read_text(encoding="utf-8").split(ENDOFTEXT)[1:]:
        ids += eot + tokenizer.encode(doc, add_special_tokens=False)
    return np.array(ids)


def bits_per_byte(llm: ob.LLM, stream: np.ndarray, window: int, count: int) -> float:
    """Window i feeds tokens [iW, (i+1)W) and is scored on tokens [iW+1, (i+1)W+1]; control tokens
    stand for no bytes (their cost still counts)."""
    pieces = llm.tokenizer.token_pieces
    nbytes = np.array(
        [0 if pieces.is_control(i) else len(pieces.token_bytes(i)) for i in range(llm.tokenizer.vocab_size)]
    )
    bits, total_bytes = 0.0, 0
    for i in range(count):
        win = stream[i * window : (i + 1) * window + 1]
        logits = llm.logits(win[:-1].tolist()).astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        bits += float((log_z - logits[np.arange(window), win[1:]]).sum()) / math.log(2)
        total_bytes += int(nbytes[win[1:]].sum())
    return bits / total_bytes

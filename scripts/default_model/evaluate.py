"""Bits per byte, the one measure the training log, the GGUF metadata and the engine check share.

The evaluation stream is the held-out documents, each preceded by ``<|endoftext|>``, cut into windows
of ``window`` tokens. Window i feeds tokens [iW, (i+1)W) and is scored on predicting tokens
[iW+1, (i+1)W+1): every token but the first is predicted once, with at most W-1 tokens of context.
Bits are the summed negative log2-probabilities; bytes are the UTF-8 bytes the predicted tokens stand
for (zero for ``<|endoftext|>``, whose cost is still counted). ``tests/test_default_model.py`` repeats
exactly this through the Rust engine."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from model import Qwen3


def windows(stream: np.ndarray, window: int, limit: int | None = None) -> list[np.ndarray]:
    """Windows of ``window + 1`` tokens (inputs are [:-1], targets [1:]), overlapping by one token."""
    count = (len(stream) - 1) // window
    if limit is not None:
        count = min(count, limit)
    return [stream[i * window : (i + 1) * window + 1] for i in range(count)]


def target_bytes(wins: list[np.ndarray], token_bytes: list[bytes]) -> int:
    lengths = np.array([len(b) for b in token_bytes])
    return int(sum(lengths[w[1:]].sum() for w in wins))


@torch.no_grad()
def model_bits_per_byte(
    model: Qwen3, wins: list[np.ndarray], token_bytes: list[bytes], batch: int = 8
) -> float:
    """In float32 (no autocast), as the shipped model is evaluated; on the model's device."""
    model.eval()
    device = model.embed.device
    nats = 0.0
    for i in range(0, len(wins), batch):
        chunk = torch.from_numpy(np.stack(wins[i : i + batch]).astype(np.int64)).to(device)
        logits = model(chunk[:, :-1]).float()
        nats += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
        ).item()
    model.train()
    return nats / math.log(2) / target_bytes(wins, token_bytes)


def unigram_bits_per_byte(
    train_stream: np.ndarray, vocab_size: int, wins: list[np.ndarray], token_bytes: list[bytes]
) -> float:
    """A unigram model over the same tokenizer: training-set frequencies with add-one smoothing."""
    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0
    log2p = np.log2(counts / counts.sum())
    bits = -sum(log2p[w[1:]].sum() for w in wins)
    return float(bits / target_bytes(wins, token_bytes))

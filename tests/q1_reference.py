"""Independent numpy implementations of the Q1_0 format (ggml's reference rules), of int8 activation
quantization and of the exact value of the int8 kernels. Written from the format description in
shared/KERNELS.md, not from the Rust code."""

from __future__ import annotations

import numpy as np

QK = 128


def quantize(w: np.ndarray) -> bytes:
    """ggml quantize_row_q1_0_ref: d = (sequential f32 sum of |x|) / 128 as fp16, bit = x >= 0."""
    blocks = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK)
    total = np.cumsum(np.abs(blocks), axis=1, dtype=np.float32)[:, -1]
    d = (total / np.float32(QK)).astype(np.float32).astype("<f2")
    qs = np.packbits(blocks >= 0, axis=1, bitorder="little")
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1)
    return out.tobytes()


def unpack(buf: bytes, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales float32 (rows, cols/128), signs int8 (rows, cols) of +1/-1)."""
    raw = np.frombuffer(buf, dtype=np.uint8).reshape(rows * cols // QK, 18)
    d = raw[:, :2].copy().view("<f2").astype(np.float32).reshape(rows, cols // QK)
    bits = np.unpackbits(raw[:, 2:], axis=1, bitorder="little").reshape(rows, cols)
    return d, bits.astype(np.int8) * 2 - 1


def dequantize(buf: bytes, rows: int, cols: int) -> np.ndarray:
    d, signs = unpack(buf, rows, cols)
    return (np.repeat(d, QK, axis=1) * signs).astype(np.float32)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 per 128 values: scale = amax / 127, q = round-half-even(x * (127 / amax)), clamp ±127."""
    n, k = x.shape
    xb = x.reshape(n, k // QK, QK).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    scale = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(n, k), scale


def exact_int8(buf: bytes, rows: int, cols: int, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float64 sum over blocks of d_w * d_a * sum(sign * q): the value every int8 kernel computes."""
    d, signs = unpack(buf, rows, cols)
    n = q.shape[0]
    out = np.zeros((n, rows), dtype=np.float64)
    for b in range(cols // QK):
        cols_b = slice(b * QK, (b + 1) * QK)
        isum = q[:, cols_b].astype(np.float64) @ signs[:, cols_b].astype(np.float64).T
        out += isum * scale[:, b : b + 1].astype(np.float64) * d[:, b].astype(np.float64)[None, :]
    return out

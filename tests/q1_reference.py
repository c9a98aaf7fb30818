"""Independent numpy implementations of the Q1_0 format (ggml's reference rules), of the kernels'
activation quantization (int16, one L1-bounded scale per 128 values) and of the exact value of the
quantized kernels. Written from the format description in shared/KERNELS.md and the rule chosen in
issue 26 (benches/act_quant_study.py), not from the Rust code."""

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


L1_FIXED = 2.0**16
L1_BUDGET = 32767 - QK - 64  # sum |q| <= 32639 per block (rounding adds <= 64): q = 256 * hi + lo in bytes
L1_MAX = 32639
MIN_AMAX = 2.0**-96  # smaller blocks quantize to zero, which keeps every step finite


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' rule, (q int16 (n, k), scale float32 (n, k/128)): one scale per 128 values such
    that the block's sum of |q| is <= 32639, so every signed sum of its values (a LUT entry, an int16
    accumulator) is exact in int16. The L1 norm is order-free, the same bits on every ISA:
    T = sum of floor(|x| * (2^16 / amax)) in integers, L1 <= (T + 128) * amax / 2^16,
    scale = (T + 128) * (amax / 2^16) / 32575, q = round_half_even(x * (1 / scale))."""
    n, k = x.shape
    xb = x.astype(np.float32).reshape(n, k // QK, QK)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    live = amax >= np.float32(MIN_AMAX)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        fixed = np.where(live, np.float32(L1_FIXED) / amax, np.float32(0)).astype(np.float32)
        t = np.floor(np.abs(xb) * fixed).astype(np.int64).sum(axis=2, keepdims=True)
        scale = (t + QK).astype(np.float32) * (amax / np.float32(L1_FIXED)) / np.float32(L1_BUDGET)
        scale = np.where(live, scale, np.float32(0)).astype(np.float32)
        inv = np.where(live, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv).astype(np.int16)
    assert np.abs(q.astype(np.int64)).sum(axis=2).max() <= L1_MAX
    return q.reshape(n, k), scale[:, :, 0]


def quantize_activations_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int8 rule the kernels used before issue 26 (for comparisons): int8 per 128 values,
    scale = amax / 127, q = round-half-even(x * (127 / amax)), clamp ±127."""
    n, k = x.shape
    xb = x.reshape(n, k // QK, QK).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    scale = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(n, k), scale


def dequantized(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float64 values of per-128 quantized activations."""
    n, k = q.shape
    return (q.reshape(n, k // QK, QK).astype(np.float64) * scale[:, :, None]).reshape(n, k)


def exact_quantized(buf: bytes, rows: int, cols: int, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float64 sum over blocks of d_w * d_a * sum(sign * q): the value every quantized kernel computes."""
    d, signs = unpack(buf, rows, cols)
    n = q.shape[0]
    out = np.zeros((n, rows), dtype=np.float64)
    for b in range(cols // QK):
        cols_b = slice(b * QK, (b + 1) * QK)
        isum = q[:, cols_b].astype(np.float64) @ signs[:, cols_b].astype(np.float64).T
        out += isum * scale[:, b : b + 1].astype(np.float64) * d[:, b].astype(np.float64)[None, :]
    return out


def fused_linear(
    x: np.ndarray,
    w64: np.ndarray,
    norm: np.ndarray | None,
    residual: np.ndarray | None,
    gated: bool,
    eps: float,
) -> np.ndarray:
    """The torch path's fused Q1 linear in float64 (``ref_torch.q1_fused_linear``): ``rms_norm(x, norm)``
    when ``norm`` is given, times ``w64.T``, ``silu(gate) * up`` of a gate|up matrix when ``gated``,
    plus ``residual``."""
    x64 = x.astype(np.float64)
    if norm is not None:
        x64 = x64 / np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + eps) * norm
    y = x64 @ w64.T
    if gated:
        gate, up = np.split(y, 2, axis=1)
        y = gate / (1 + np.exp(-gate)) * up
    return y if residual is None else y + residual

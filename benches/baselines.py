"""What our kernels are compared against, apart from our own sign-flip kernel: plain numpy.

`numpy_q1_matmul` computes straight from GGUF Q1_0 bytes the way a careful numpy user would: it
dequantizes a slab of rows at a time (`np.unpackbits`, one fused sign-and-scale pass) into a reused
float32 buffer small enough to stay in L2, and hands each slab to BLAS. Working on slabs, rather than
dequantizing the whole matrix first, keeps the temporaries out of main memory; that is the only trick.
`random_q1_bytes` makes the GGUF bytes the benchmarks run on.
"""

from __future__ import annotations

import numpy as np

QK = 128  # weights per Q1_0 block
BLOCK_BYTES = 18  # fp16 scale + 16 bytes of sign bits
SLAB_BYTES = 512 << 10  # float32 rows dequantized per BLAS call


def random_q1_bytes(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """GGUF Q1_0 bytes (flat uint8) for a rows x cols matrix: random signs, scales like a real layer's."""
    blocks = rng.integers(0, 256, size=(rows * cols // QK, BLOCK_BYTES), dtype=np.uint8)
    scales = rng.uniform(0.005, 0.05, size=len(blocks)).astype("<f2")
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def numpy_q1_matmul(raw: np.ndarray, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    """W @ x for W given as GGUF Q1_0 bytes; x is (cols,) or (n, cols), the result (rows,) or (n, rows)."""
    nb = cols // QK
    blocks = raw.reshape(rows, nb, BLOCK_BYTES)
    x2 = x.reshape(-1, cols)
    out = np.empty((x2.shape[0], rows), dtype=np.float32)
    slab = max(1, SLAB_BYTES // (4 * cols))
    w = np.empty((slab, nb, QK), dtype=np.float32)
    for r0 in range(0, rows, slab):
        part = blocks[r0 : r0 + slab]
        m = len(part)
        # bit set -> +d, clear -> -d: w = (2 * bit - 1) * d = bit * (2d) - d
        d = part[:, :, :2].copy().view("<f2")[:, :, 0].astype(np.float32)[:, :, None]
        bits = np.unpackbits(part[:, :, 2:], axis=2, bitorder="little")
        np.multiply(bits, 2 * d, out=w[:m])
        w[:m] -= d
        np.matmul(x2, w[:m].reshape(m, cols).T, out=out[:, r0 : r0 + m])
    return out.reshape(rows) if x.ndim == 1 else out

"""Q1_0 matrices as packed torch tensors: the layout every Q1 kernel of the torch path reads.

A GGUF Q1_0 row of K weights is K/128 blocks of 18 bytes (fp16 scale ``d``, then 16 bytes of sign
bits, LSB first; a set bit is +d). ``Q1Weight`` splits the blocks into two dense arrays (structure of
arrays): int32 sign words ``[rows, cols // 32]`` and fp16 scales ``[rows, cols // 128]``. Read as
little-endian words, the 16 sign bytes of a block already are its 4 words (bit ``j % 32`` of word
``j // 32`` is GGUF's bit ``j % 8`` of byte ``j // 8``), so loading copies the bytes once and never
builds a dense float matrix. ``dequantize`` exists for tests and oracles only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 128  # weights per Q1_0 block: one fp16 scale each
BLOCK_BYTES = 18  # 2 bytes of scale + 16 bytes of signs
WORD_BITS = 32


@dataclass(frozen=True)
class Q1Weight:
    """A ``rows x cols`` Q1_0 matrix: weight ``(r, j)`` is ``+-scales[r, j // 128]``, + where bit
    ``j % 32`` of ``signs[r, j // 32]`` is set."""

    signs: torch.Tensor  # int32 [rows, cols // 32]
    scales: torch.Tensor  # float16 [rows, cols // 128]
    rows: int
    cols: int

    @staticmethod
    def from_gguf(raw: np.ndarray, rows: int, cols: int, device: torch.device | str = "cpu") -> Q1Weight:
        """Repack GGUF Q1_0 bytes (``rows * cols // 128 * 18`` uint8, any shape, possibly a read-only
        view into a memory map) into sign words and scales on ``device``."""
        blocks = _blocks(raw, rows, cols)
        scales = np.ascontiguousarray(blocks[:, :2]).view("<f2").astype(np.float16, copy=False)
        signs = np.ascontiguousarray(blocks[:, 2:]).view("<i4").astype(np.int32, copy=False)
        return Q1Weight(
            signs=torch.from_numpy(signs.reshape(rows, cols // WORD_BITS)).to(device),
            scales=torch.from_numpy(scales.reshape(rows, cols // QK)).to(device),
            rows=rows,
            cols=cols,
        )

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32 ``[rows, cols]`` (tests and oracles only)."""
        return unpack(self.signs, self.scales)

    def rows_dequantized(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 ``[len(ids), cols]`` (an embedding lookup), touching only those rows."""
        ids = ids.to(device=self.signs.device, dtype=torch.long)
        return unpack(self.signs[ids], self.scales[ids])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.signs, self.scales))


def unpack(signs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, cols]`` from sign words ``[n, cols // 32]`` and scales ``[n, cols // 128]``."""
    shifts = torch.arange(WORD_BITS, device=signs.device, dtype=torch.int32)
    bits = (signs.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 still lands in bit 0
    pm_one = bits.reshape(signs.shape[0], -1).to(torch.float32) * 2 - 1
    return pm_one * scales.to(torch.float32).repeat_interleave(QK, dim=1)


def _blocks(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``raw`` as a ``[blocks, 18]`` uint8 view, after checking the shape against ``rows x cols``."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise ValueError(f"Q1_0 data must be a uint8 numpy array, got {getattr(raw, 'dtype', type(raw))}")
    if rows <= 0 or cols <= 0 or cols % QK != 0:
        raise ValueError(f"a Q1_0 matrix needs rows > 0 and cols a positive multiple of {QK}: {rows}x{cols}")
    expected = rows * cols // QK * BLOCK_BYTES
    if raw.size != expected:
        raise ValueError(f"a {rows}x{cols} Q1_0 matrix is {expected} bytes, got {raw.size}")
    return raw.reshape(-1, BLOCK_BYTES)

"""The matrices a benchmark runs on: shapes, and each shape's pool of distinct Q1_0 matrices.

A pool is built from random GGUF Q1_0 bytes. Cache-resident benchmarks reuse its first matrix;
memory-resident ones cycle through enough distinct matrices that their Q1_0 bytes (POOL_BYTES) are far
larger than any cache. The float32 baseline gets its own pool of the same total size, dequantized from
the same matrices. OXIBONSAI_BENCH_QUICK=1 shrinks everything so the suite can be checked in seconds
(with --benchmark-disable); numbers from a quick run mean nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from baselines import BLOCK_BYTES, QK, random_q1_bytes

from oxibonsai import Q1Matrix

QUICK = os.environ.get("OXIBONSAI_BENCH_QUICK", "") not in ("", "0")

# (rows, cols) of Bonsai-1.7B's layers: q/o projections, gate/up, down, and a 4096x4096 stand-in;
# the quick set keeps their proportions at 1/8 of the size.
FULL_SHAPES = ((2048, 2048), (6144, 2048), (2048, 6144), (4096, 4096))
QUICK_SHAPES = ((256, 256), (768, 256), (256, 768), (512, 512))
SHAPES = QUICK_SHAPES if QUICK else FULL_SHAPES
POOL_BYTES = (1 << 20) if QUICK else (256 << 20)
RESIDENCIES = ("cache", "memory")


@dataclass
class Workload:
    """One shape's matrices: GGUF bytes, the same loaded as Q1Matrix, and (lazily) dequantized float32."""

    rows: int
    cols: int
    raw: list[np.ndarray]
    q1: list[Q1Matrix]
    _f32: list[np.ndarray] = field(default_factory=list)

    @classmethod
    def build(cls, rows: int, cols: int) -> Workload:
        rng = np.random.default_rng(rows * 100003 + cols)
        count = -(-POOL_BYTES // (rows * cols // QK * BLOCK_BYTES))
        raw = [random_q1_bytes(rng, rows, cols) for _ in range(count)]
        return cls(rows, cols, raw, [Q1Matrix.from_bytes(r, rows, cols) for r in raw])

    @property
    def shape(self) -> str:
        return f"{self.rows}x{self.cols}"

    def count(self, residency: str) -> int:
        """How many Q1_0 matrices a benchmark of this residency cycles through."""
        return 1 if residency == "cache" else len(self.q1)

    def f32(self, residency: str) -> list[np.ndarray]:
        """The float32 pool: one matrix, or enough for POOL_BYTES of float32."""
        count = 1 if residency == "cache" else -(-POOL_BYTES // (4 * self.rows * self.cols))
        while len(self._f32) < count:
            self._f32.append(self.q1[len(self._f32)].dequantize())
        return self._f32[:count]

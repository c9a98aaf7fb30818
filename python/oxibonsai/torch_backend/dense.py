"""``DenseWeight``: a matrix stored as float (F32/F16/BF16 in the GGUF, or a benchmark's fp16 baseline)
with the calls a ``Q1Weight`` serves, and ``Linear``, either kind."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oxibonsai.torch_backend.ops.q1_weight import Q1Weight


@dataclass(frozen=True)
class DenseWeight:
    """An F32/F16/BF16 matrix, held as float32 ``w [rows, cols]``; the ``Q1Weight`` calls it serves."""

    w: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.w.shape[0])

    @property
    def cols(self) -> int:
        return int(self.w.shape[1])

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``[M, rows]`` = ``x [M, cols] @ w.T``."""
        return x.float() @ self.w.T

    def rows_dequantized(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[len(ids), cols]``: the rows ``ids`` (an embedding lookup)."""
        return self.w.index_select(0, ids)

    def dequantize(self) -> torch.Tensor:
        return self.w


Linear = Q1Weight | DenseWeight

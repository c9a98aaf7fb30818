"""Triton embedding lookup of a Q1_0 matrix: the twin of ``ref_torch.embedding``, one launch per step
instead of the reference's handful of elementwise ones.

One program per (token, 128-value block) writes the block's weights, ``+d`` where the sign bit is set
and ``-d`` where not: the same float32 values ``Q1Weight.rows_dequantized`` gives. Token ids must be
rows of the matrix (the engine checks prompts against the vocabulary; a sampled id is one)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oxibonsai.torch_backend.ops import pdl
from oxibonsai.torch_backend.ops.pdl import grid_dependency
from oxibonsai.torch_backend.ops.q1_weight import QK, Q1Weight


@triton.jit
def _embedding_kernel(
    ids_ptr, signs_ptr, scales_ptr, out_ptr, stride_s, stride_d, stride_o, PDL: tl.constexpr
):
    """Block ``program_id(1)`` of the row of token ``program_id(0)``."""
    grid_dependency(PDL)
    token, block = tl.program_id(0), tl.program_id(1)
    row = tl.load(ids_ptr + token).to(tl.int64)
    cols = tl.arange(0, 128)
    words = tl.load(signs_ptr + row * stride_s + block * 4 + cols // 32)
    bits = (words >> (cols % 32)) & 1
    d = tl.load(scales_ptr + row * stride_d + block).to(tl.float32)
    tl.store(out_ptr + token * stride_o + block * 128 + cols, tl.where(bits != 0, d, -d))


def embedding(ids: torch.Tensor, w: Q1Weight) -> torch.Tensor:
    """Rows ``ids`` of ``w``: float32 ``[T, cols]``."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got {list(ids.shape)}")
    ids = ids.to(device=w.signs.device)
    out = torch.empty(ids.shape[0], w.cols, dtype=torch.float32, device=w.signs.device)
    if ids.shape[0]:
        _embedding_kernel[(ids.shape[0], w.cols // QK)](
            ids, w.signs, w.scales, out, w.signs.stride(0), w.scales.stride(0), out.stride(0),
            **pdl.launch(out.device),
        )  # fmt: skip
    return out

"""Triton RMSNorm: the twin of ``ref_torch.rms_norm``.

One program per row of the 2-D view ``[rows, H]`` computes ``x / sqrt(mean(x^2) + eps) * weight`` in
float32; the wrapper flattens leading dimensions, so ``[T, heads, D]`` (QK-norm) works too."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, hidden, eps, stride_x, stride_o, BLOCK: tl.constexpr):
    """Normalize row ``program_id(0)``."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    tl.store(out_ptr + row * stride_o + offs, x * rstd * w, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``: float32, the shape of ``x``."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {list(weight.shape)}")
    rows = x.reshape(-1, hidden)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        w = weight.contiguous()
        _rms_norm_kernel[(rows.shape[0],)](
            rows, w, out, hidden, eps, rows.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(hidden)
        )
    return out.reshape(x.shape)

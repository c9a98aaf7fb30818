"""Activations quantized ahead: an op set whose Q1 matmuls take quantized activations (the exact
Triton set) may quantize a matmul's output for the next matmul inside the matmul's own launch, saving
the quantization's launch. No Triton here, so the model imports it on any device.

Such an op set has two more ops, each returning ``(out, ahead)``:

- ``q1_fused_linear_ahead(x, w, *, norm, eps, residual, gated, acts=None, then=None)``: the
  ``q1_fused_linear``, where ``acts`` (when given) is what ``then`` of the matmul before gave, the
  quantization of ``rms_norm(x, norm)``, and ``ahead`` is the output's quantization as ``then``
  asks (None without ``then``);
- ``attention_linear_ahead(*args, w, *, residual, then=None, **hints)``: the ``attention_linear``.

``ahead`` is opaque to the model; it carries the same bits as quantizing the output in a launch of its
own. ``OXIBONSAI_FUSE_QUANTIZE=0`` keeps the ops but quantizes in launches of their own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

OPS = ("q1_fused_linear_ahead", "attention_linear_ahead")


@dataclass(frozen=True)
class QuantizeNext:
    """How a matmul's output is quantized for the next matmul: ``rms_norm(out, norm)`` (no norm when
    None) with ``eps``, then quantized."""

    norm: torch.Tensor | None = None
    eps: float = 0.0


def supported(ops: Any) -> bool:
    """Whether the op set ``ops`` quantizes ahead."""
    return all(hasattr(ops, name) for name in OPS)

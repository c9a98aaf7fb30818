"""Fused matrices: Q, K and V (and gate and up) stacked by rows into one matrix at load, so each layer
runs one matmul where it ran three (two), a kernel launch and a pass over the activations saved per
matmul on a GPU. The separate matrices stay available as row views of the fused one (no copies).
Matrices of different kinds (a Q1 and a dense one) are left unfused."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oxibonsai.torch_backend.dense import DenseWeight, Linear
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight


def fuse_rows(parts: Sequence[Linear]) -> Linear | None:
    """One matrix holding ``parts``' rows in order, or None when they cannot be stacked."""
    if all(isinstance(p, Q1Weight) for p in parts):
        q1 = [p for p in parts if isinstance(p, Q1Weight)]
        if len({p.cols for p in q1}) != 1:
            return None
        return Q1Weight(
            signs=torch.cat([p.signs for p in q1]),
            scales=torch.cat([p.scales for p in q1]),
            rows=sum(p.rows for p in q1),
            cols=q1[0].cols,
        )
    if all(isinstance(p, DenseWeight) for p in parts):
        dense = [p for p in parts if isinstance(p, DenseWeight)]
        if len({p.cols for p in dense}) != 1 or len({type(p) for p in dense}) != 1:
            return None
        return type(dense[0])(torch.cat([p.w for p in dense]))
    return None


def row_views(fused: Linear, rows: Sequence[int]) -> list[Linear]:
    """The consecutive row ranges of ``fused`` with the given sizes, as matrices sharing its memory."""
    views: list[Linear] = []
    start = 0
    for n in rows:
        stop = start + n
        if isinstance(fused, Q1Weight):
            views.append(Q1Weight(fused.signs[start:stop], fused.scales[start:stop], n, fused.cols))
        else:
            views.append(type(fused)(fused.w[start:stop]))
        start = stop
    return views

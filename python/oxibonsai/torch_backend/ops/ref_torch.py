"""The plain-torch ops of the torch path: the oracle for every Triton kernel and the CPU/MPS path.

Each op runs on any torch device with stock torch operations and returns float32. They favour
clarity over speed but keep memory bounded: ``q1_linear`` dequantizes a slice of rows at a time and
``paged_attention`` gathers one sequence's blocks at a time. Paged KV caches are
``[blocks, block_size, kv_heads, head_dim]``; slot ``s`` is block ``s // block_size``, offset
``s % block_size``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from oxibonsai._core import rope_frequencies
from oxibonsai.rope_scaling import RopeScaling
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight, unpack

DEQUANT_CHUNK_FLOATS = 8 * 1024 * 1024  # 32 MiB of float32 per dequantized slice of a weight


def q1_linear(x: torch.Tensor, w: Q1Weight) -> torch.Tensor:
    """``x [M, K] @ W.T`` -> float32 ``[M, N]``, dequantizing at most ``DEQUANT_CHUNK_FLOATS`` at a time."""
    x = x.to(torch.float32)
    out = torch.empty(x.shape[0], w.rows, dtype=torch.float32, device=x.device)
    step = max(1, DEQUANT_CHUNK_FLOATS // w.cols)
    for start in range(0, w.rows, step):
        stop = min(start + step, w.rows)
        out[:, start:stop] = x @ unpack(w.signs[start:stop], w.scales[start:stop]).T
    return out


def q1_fused_linear(
    x: torch.Tensor,
    w: Q1Weight,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """A matmul with its neighbours in the model: ``rms_norm(x, norm, eps)`` in (``norm``), then
    ``x @ W.T``; ``gated``: W stacks the gate rows over the up rows and the result is
    ``silu(gate) * up``; then ``residual +`` it (``residual``). float32 ``[M, rows or rows / 2]``.
    (The Triton twin runs it as one GEMV launch and its epilogue.)"""
    return fused_linear(q1_linear, x, w, norm=norm, eps=eps, residual=residual, gated=gated)


def fused_linear(
    linear: Callable[[torch.Tensor, Q1Weight], torch.Tensor],
    x: torch.Tensor,
    w: Q1Weight,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """``q1_fused_linear`` composed around any Q1 ``linear`` (an op set's own matmul)."""
    if norm is not None:
        x = rms_norm(x, norm, eps)
    y = linear(x, w)
    if gated:
        y = silu_mul(*y.chunk(2, dim=1))
    return y if residual is None else y + residual.to(torch.float32)


def embedding(ids: torch.Tensor, w: Q1Weight) -> torch.Tensor:
    """Rows ``ids`` of the embedding matrix: float32 ``[T, K]``."""
    return w.rows_dequantized(ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (also per head for QK-norm)."""
    x = x.to(torch.float32)
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * weight.to(torch.float32)


def rope_neox(
    x: torch.Tensor, positions: torch.Tensor, base: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """NeoX (rotate-half) RoPE of ``x [T, heads, D]`` at ``positions [T]``: pairs ``(i, i + D/2)``
    turn by ``position`` times the pair's frequency (``base^(-2i/D)``, stretched by ``scaling``)."""
    cos, sin = _cos_sin(positions, x.shape[-1], base, scaling)
    return _rotate_half(x, cos.to(x.device), sin.to(x.device))


def rope_cos_sin(
    positions: int,
    head_dim: int,
    base: float,
    device: torch.device | str,
    scaling: RopeScaling | None = None,
) -> torch.Tensor:
    """The RoPE table of positions ``0..positions - 1``: float32 ``[positions, head_dim]``, the cos of
    a position's ``head_dim / 2`` angles then their sin, exactly the values ``rope_neox`` computes."""
    cos, sin = _cos_sin(torch.arange(positions), head_dim, base, scaling)
    return torch.cat([cos, sin], dim=-1).to(device)


def _cos_sin(
    positions: torch.Tensor, head_dim: int, base: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[T, head_dim / 2]`` cos and sin of the angles at ``positions``, computed in float64
    on the host from the Rust core's frequencies and multiplied by its attention factor, as the native
    runner does (the fastest pair's float32 angle at position 131,072 would be rounded by up to
    2^-7 rad)."""
    inv_freq, attention = rope_frequencies(head_dim, base, scaling)
    angles = positions.detach().to("cpu", torch.float64)[:, None] * torch.from_numpy(inv_freq)[None, :]
    return (angles.cos() * attention).to(torch.float32), (angles.sin() * attention).to(torch.float32)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]`` turned by the angles whose ``cos``, ``sin [T, D/2]`` are given."""
    half = x.shape[-1] // 2
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]
    x = x.to(torch.float32)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope_write_kv(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_heads: int,
    cos_sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The attention block between the QKV matmul and attention, as one op: ``qkv [T, (Hq + 2 Hkv) D]``
    splits into q, k, v by columns; q and k get per-head RMSNorm (``q_norm``, ``k_norm`` ``[D]``) and
    NeoX RoPE at ``positions``, turned by the rows of the table ``cos_sin`` (``rope_cos_sin``); k and v
    are stored at ``slot_mapping`` (-1: nothing stored). Returns float32 q ``[T, Hq, D]``. (The Triton
    twin does it in one kernel launch.)"""
    t, head_dim = qkv.shape[0], q_norm.shape[0]
    kv_heads = k_cache.shape[2]
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    cos, sin = cos_sin.index_select(0, positions.to(device=cos_sin.device, dtype=torch.long)).chunk(2, dim=1)
    q = _rotate_half(rms_norm(q.reshape(t, q_heads, head_dim), q_norm, eps), cos, sin)
    k = _rotate_half(rms_norm(k.reshape(t, kv_heads, head_dim), k_norm, eps), cos, sin)
    write_kv(k, v.reshape(t, kv_heads, head_dim), k_cache, v_cache, slot_mapping)
    return q


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in float32 (the SwiGLU of the MLP)."""
    return F.silu(gate.to(torch.float32)) * up.to(torch.float32)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k, v [T, kv_heads, D]`` at cache slots ``slot_mapping [T]`` (in place, cast to the cache
    dtype); a slot of -1 marks a padding row and is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.long)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def composed_attention_linear(
    attention: Callable[..., torch.Tensor],
    fused_linear: Callable[..., torch.Tensor],
    q: torch.Tensor,
    *args: Any,
    residual: torch.Tensor | None = None,
    **hints: Any,
) -> torch.Tensor:
    """``residual + attention(q, ...) @ W.T`` from an op set's own ``paged_attention`` and
    ``q1_fused_linear`` (``args``: the caches, plan tensors and scale ``paged_attention`` takes, then W;
    ``hints``: its keywords): the ``attention_linear`` op of the sets that do not fuse it."""
    *attention_args, w = args
    out = attention(q, *attention_args, **hints)
    return fused_linear(out.reshape(q.shape[0], -1), w, residual=residual)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    decode_from: torch.Tensor | None = None,
    decode_rows: torch.Tensor | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [T, Hq, D]`` over each sequence's paged KV: float32 ``[T, Hq, D]``.
    (``decode_from``, ``decode_rows`` and ``max_q_len``, which pick and size the Triton twin's kernels,
    are accepted for its signature: every row is computed the same way here.)

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``, the last ``q_len`` of
    its ``seq_lens[s]`` positions; its KV position ``p`` is in block ``block_tables[s, p // block_size]``.
    Query head ``h`` reads KV head ``h // (Hq // kv_heads)``. Rows owned by no sequence stay zero."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for s, kv_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[s], starts[s + 1])
        if rows.stop > rows.start:
            keys, values = _gather_kv(k_cache, v_cache, block_tables[s], kv_len)
            out[rows] = _causal_attention(q[rows], keys, values, scale)
    return out


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``kv_len`` keys and values, float32 ``[kv_len, kv_heads, D]``."""
    block_size = k_cache.shape[1]
    blocks = block_table[: -(-kv_len // block_size)].to(torch.long)
    keys = k_cache[blocks].flatten(0, 1)[:kv_len]
    values = v_cache[blocks].flatten(0, 1)[:kv_len]
    return keys.to(torch.float32), values.to(torch.float32)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [n, Hq, D]`` as the last ``n`` positions of ``k, v [L, kv_heads, D]``: ``[n, Hq, D]``."""
    n, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    query_pos = torch.arange(kv_len - n, kv_len, device=q.device)
    mask = torch.arange(kv_len, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.to(torch.float32).transpose(0, 1), k, v, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


# The attention block after its projections: ``residual + paged_attention(...) @ W.T``, the attention
# output ``[T, Hq, D]`` read as ``[T, Hq * D]`` rows; arguments as ``composed_attention_linear``'s after
# its first two. The exact Triton set fuses the quantization of those rows into its decode kernels.
attention_linear = functools.partial(composed_attention_linear, paged_attention, q1_fused_linear)

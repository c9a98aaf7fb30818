"""Triton QK-norm + RoPE + KV-cache write: the twin of ``ref_torch.qk_norm_rope_write_kv``, in one launch.

Grid ``(T,)``: one program per token row of ``qkv [T, (Hq + 2 Hkv) D]`` handles all of its heads as
2-D tiles ``[BLOCK_H, D/2]``. Each head is loaded as its low and high halves (columns ``i`` and
``i + D/2``), so the NeoX rotate-half is elementwise with no shuffles:

- q heads: per-head RMSNorm (``q_norm``) and RoPE, written to a new float32 ``[T, Hq, D]``;
- k heads: the same with ``k_norm``, stored cast to the cache dtype at slot ``slot_mapping[t]``
  (block ``slot // block_size``, offset ``slot % block_size``, through the caches' strides); v heads
  are stored unchanged (cast). A slot of -1 (a padding row) stores nothing; its q is still returned.

Each row's cos and sin come from the model's table ``cos_sin [positions, D]`` (``ref_torch.rope_cos_sin``:
cos of the ``D/2`` angles, then their sin), so the kernel evaluates no transcendental function and
turns q and k by exactly the angles the reference does.

The attention's decode kernel does the same work itself in a decode step (``attn_triton``, ``RopeKv``)
through the same helpers, so both must give the same bits whatever their tiles: the kernel runs
without floating-point contraction, and a head's sum of squares is a fixed pairwise tree over its
values (``_head_sum``), not a reduction whose order follows the tile's layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oxibonsai.torch_backend.ops import pdl
from oxibonsai.torch_backend.ops.pdl import grid_dependency
from oxibonsai.torch_backend.ops.q1_exact import NO_FUSION


@triton.jit
def _head_sum(x, BLOCK_HALF: tl.constexpr):
    """Row sums of ``x [H, BLOCK_HALF]`` (a power of 2) by a fixed pairwise tree, neighbours first: the
    same bits whatever the tile's layout."""
    for level in tl.static_range(BLOCK_HALF.bit_length() - 1):
        x = tl.reshape(x, [x.shape[0], BLOCK_HALF >> (level + 1), 2])
        a, b = tl.split(x)
        x = a + b
    return tl.reshape(x, [x.shape[0]])


@triton.jit
def _norm_rope(
    head_ptr, w_ptr, offs_h, offs_d, mask, half, head_dim, eps, cos, sin, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """RMSNorm (weight ``w_ptr``) then RoPE of the heads ``offs_h`` that start at ``head_ptr``: the low
    and high halves, float32 ``[BLOCK_H, BLOCK_HALF]`` each."""
    lo_ptrs = head_ptr + offs_h[:, None] * head_dim + offs_d[None, :]
    lo = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(lo_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(_head_sum(lo * lo + hi * hi, BLOCK_HALF) / head_dim + eps)
    mask_d = offs_d < half
    w_lo = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    w_hi = tl.load(w_ptr + half + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    lo = lo * rstd[:, None] * w_lo[None, :]
    hi = hi * rstd[:, None] * w_hi[None, :]
    return lo * cos[None, :] - hi * sin[None, :], hi * cos[None, :] + lo * sin[None, :]


@triton.jit
def _angles(cos_sin_ptr, pos_ptr, t, stride_cs, half, BLOCK_HALF: tl.constexpr):
    """Row ``t``'s RoPE: the half-head offsets and their mask, then cos and sin ``[BLOCK_HALF]``."""
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    angles = cos_sin_ptr + tl.load(pos_ptr + t).to(tl.int64) * stride_cs + offs
    return offs, mask, tl.load(angles, mask=mask, other=0.0), tl.load(angles + half, mask=mask, other=0.0)


@triton.jit
def _write_kv_heads(
    qkv_row, k_norm_ptr, k_cache_ptr, v_cache_ptr, slot, first, offs_h, offs_d, mask, q_heads, kv_heads,
    half, head_dim, eps, cos, sin, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    PAGE: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """KV heads ``first + offs_h`` of a QKV row (where ``mask``): K normed and rotated, stored with V at
    cache slot ``slot``."""
    k_row = qkv_row + (q_heads + first) * head_dim
    k_lo, k_hi = _norm_rope(k_row, k_norm_ptr, offs_h, offs_d, mask, half, head_dim, eps, cos, sin,
                            BLOCK_HALF)  # fmt: skip
    v_ptrs = k_row + kv_heads * head_dim + offs_h[:, None] * head_dim + offs_d[None, :]
    v_lo = tl.load(v_ptrs, mask=mask)
    v_hi = tl.load(v_ptrs + half, mask=mask)
    slot = tl.maximum(slot, 0).to(tl.int64)
    block, offset = slot // PAGE, slot % PAGE
    heads = first + offs_h[:, None]
    k_dst = k_cache_ptr + block * stride_kb + offset * stride_ks + heads * stride_kh + offs_d[None, :]
    v_dst = v_cache_ptr + block * stride_vb + offset * stride_vs + heads * stride_vh + offs_d[None, :]
    tl.store(k_dst, k_lo.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_dst + half, k_hi.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v_lo.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + half, v_hi.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_write_kv_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, cos_sin_ptr,
    q_heads, kv_heads, head_dim, eps,
    stride_qkv, stride_cs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    PAGE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)``: write its normed, rotated q; store its k and v unless the slot is negative."""
    grid_dependency(PDL)
    t = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    offs_d, mask_d, cos, sin = _angles(cos_sin_ptr, pos_ptr, t, stride_cs, half, BLOCK_HALF)
    row = qkv_ptr + t * stride_qkv

    offs_hq = tl.arange(0, BLOCK_HQ)
    mask_q = (offs_hq[:, None] < q_heads) & mask_d[None, :]
    q_lo, q_hi = _norm_rope(
        row, q_norm_ptr, offs_hq, offs_d, mask_q, half, head_dim, eps, cos, sin, BLOCK_HALF
    )
    q_dst = q_out_ptr + t * q_heads * head_dim + offs_hq[:, None] * head_dim + offs_d[None, :]
    tl.store(q_dst, q_lo, mask=mask_q)
    tl.store(q_dst + half, q_hi, mask=mask_q)

    slot = tl.load(slots_ptr + t)
    offs_hk = tl.arange(0, BLOCK_HKV)
    heads = tl.where(slot >= 0, kv_heads, 0)  # a padding row masks every KV head
    mask_kv = (offs_hk[:, None] < heads) & mask_d[None, :]
    _write_kv_heads(
        row, k_norm_ptr, k_cache_ptr, v_cache_ptr, slot, 0, offs_hk, offs_d, mask_kv, q_heads, kv_heads,
        half, head_dim, eps, cos, sin, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        PAGE, BLOCK_HALF,
    )  # fmt: skip


def _check_shapes(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_heads: int,
) -> None:
    """Raise ValueError unless the arguments describe one consistent ``[T, (Hq + 2 Hkv) D]`` batch."""
    if qkv.dim() != 2 or q_norm.dim() != 1:
        raise ValueError(
            f"need qkv [T, (Hq + 2 Hkv) D] and q_norm [D]: {list(qkv.shape)}, {list(q_norm.shape)}"
        )
    head_dim = q_norm.shape[0]
    if head_dim == 0 or head_dim % 2:
        raise ValueError(f"head_dim must be even and positive for rotate-half RoPE, got {head_dim}")
    if k_norm.shape != (head_dim,):
        raise ValueError(f"k_norm must be [{head_dim}] like q_norm, got {list(k_norm.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"caches must both be [B, block, Hkv, {head_dim}]: {list(k_cache.shape)}, {list(v_cache.shape)}"
        )
    if q_heads < 1:
        raise ValueError(f"q_heads must be positive, got {q_heads}")
    width = (q_heads + 2 * k_cache.shape[2]) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv width must be (q_heads + 2 * kv_heads) * head_dim = {width}, got {qkv.shape[1]}"
        )
    tokens = qkv.shape[0]
    if positions.shape != (tokens,):
        raise ValueError(f"positions must be [{tokens}] like qkv's rows, got {list(positions.shape)}")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping must be [{tokens}] like qkv's rows, got {list(slot_mapping.shape)}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' last dimension must be contiguous")


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
    """QK-norm and RoPE of ``qkv [T, (Hq + 2 Hkv) D]`` at ``positions [T]``; k and v stored at
    ``slot_mapping [T]`` (-1: nothing) in the caches ``[B, block, Hkv, D]``. Returns float32 q
    ``[T, Hq, D]``. ``cos_sin``: the RoPE table (``ref_torch.rope_cos_sin``), a row per position."""
    _check_shapes(qkv, q_norm, k_norm, positions, k_cache, v_cache, slot_mapping, q_heads)
    if cos_sin.dim() != 2 or cos_sin.shape[1] != q_norm.shape[0] or cos_sin.dtype != torch.float32:
        raise ValueError(
            f"cos_sin must be float32 [positions, {q_norm.shape[0]}], "
            f"got {cos_sin.dtype} {list(cos_sin.shape)}"
        )
    tokens, head_dim, kv_heads = qkv.shape[0], q_norm.shape[0], k_cache.shape[2]
    q = torch.empty(tokens, q_heads, head_dim, dtype=torch.float32, device=qkv.device)
    if tokens == 0:
        return q
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    q_norm, k_norm, positions, slot_mapping = (
        t.contiguous() for t in (q_norm, k_norm, positions, slot_mapping)
    )
    _qk_norm_rope_write_kv_kernel[(tokens,)](
        qkv, q_norm, k_norm, positions, slot_mapping, q, k_cache, v_cache, cos_sin,
        q_heads, kv_heads, head_dim, float(eps),
        qkv.stride(0), cos_sin.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        PAGE=k_cache.shape[1], BLOCK_HQ=triton.next_power_of_2(q_heads),
        BLOCK_HKV=triton.next_power_of_2(kv_heads), BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        **pdl.launch(qkv.device), **NO_FUSION,
    )  # fmt: skip
    return q

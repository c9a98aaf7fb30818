"""Triton KV-cache write: the twin of ``ref_torch.write_kv``.

One program per token row stores its K and V (all KV heads) at cache slot ``slot_mapping[t]``, i.e.
block ``slot // block_size``, offset ``slot % block_size``, cast to the cache dtype. A slot of -1 (a
padding row) stores nothing, so a fixed-size batch can carry padding rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    kv_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Store row ``program_id(0)`` of k and v at its slot, unless the slot is negative."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = tl.where(slot >= 0, kv_heads, 0)  # a padding row masks every head
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < head_dim)
    slot = tl.maximum(slot, 0).to(tl.int64)
    block, offset = slot // PAGE, slot % PAGE
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = (
        k_cache_ptr + block * stride_kb + offset * stride_ks + offs_h[:, None] * stride_kch + offs_d[None, :]
    )
    v_dst = (
        v_cache_ptr + block * stride_vb + offset * stride_vs + offs_h[:, None] * stride_vch + offs_d[None, :]
    )
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k, v [T, kv_heads, D]`` at ``slot_mapping [T]`` in the caches ``[B, block, kv_heads, D]``."""
    if (
        k.shape != v.shape
        or k.dim() != 3
        or k.shape[1:] != k_cache.shape[2:]
        or k_cache.shape != v_cache.shape
    ):
        raise ValueError(f"need k, v [T, Hkv, D] and caches [B, block, Hkv, D]: {k.shape}, {k_cache.shape}")
    if k.shape[0] == 0:
        return
    k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (k, v))
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' last dimension must be contiguous")
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.shape[1], k.shape[2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        PAGE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(k.shape[1]),
        BLOCK_D=triton.next_power_of_2(k.shape[2]),
    )  # fmt: skip

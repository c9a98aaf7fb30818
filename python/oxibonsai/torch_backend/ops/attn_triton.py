"""Triton paged attention over a block table: the twin of ``ref_torch.paged_attention``.

Two kernels, each for its own rows: a row at or past its sequence's ``decode_from`` (a token the
request sampled) goes through the decode kernel, any other (a prompt row) through the prefill kernel,
whatever else the step holds. A sampled token is first computed alone in a decode step, so it takes the
decode kernel then and again if a preempted request recomputes it within a longer piece; a prompt row
takes the prefill kernel whether the prompt was cached, chunked or run whole. So a row's bits never
depend on the batch or on how its sequence was cut (with the exact Q1 matmuls, a request's greedy tokens
are the same alone, batched, cached or preempted). A step with no prompt rows launches the decode
kernels only, one with no decode rows the prefill kernel only.

- decode (the rows at or past ``decode_from``, one per sequence in a decode step; the host lists them
  as ``decode_rows``, (row, sequence) pairs): split-KV. One program per (decode row, KV head, split)
  computes all ``GROUP`` query heads that share the KV head over a slice of the row's positions, and
  the program that stores the last of a (row, KV head)'s ``MAX_SPLITS`` partial results, counted
  with fenced atomics (``merge_counts``), merges them by their log-sum-exp, up to ``MERGE_MAX_ROWS``
  rows (above, and with ``OXIBONSAI_FUSE_MERGE=0``, a second kernel does: one launch a layer more).
  The split of a row's positions depends only on its own KV length, the grid only on the batch shape;
- prefill/extend (the rows before ``decode_from``): causal flash attention of a sequence's prompt rows
  against its whole cached KV. Query heads of one KV head are packed along the tile's rows (row ``r``
  is query ``r // GROUP``, head ``r % GROUP``), KV tiles start at position 0, and a tile stops at its
  last row's position (fully masked KV tiles leave a row's sums unchanged, bit for bit).

In a decode step of one row per sequence the decode kernel also does the layer's QK-norm, RoPE and
K/V write (``RopeKv``, ``OXIBONSAI_FUSE_ROPE=0`` keeps their launch): each program computes its query
heads from the QKV row, and the program whose split holds the row's new position stores its K and V
before reading the cache (a barrier; no other program reads that position), with the helpers and the
bits of ``rope_kv_triton``'s kernel. Elsewhere that kernel runs first.

``quantized_attention`` returns the O projection's activations (``q1_exact.QuantizedRows``) instead of
the float output, and ``attention_linear`` the projection itself: in a decode step the merge
quantizes each head's 128 outputs (one activation block) as it writes them, with ``q1_exact``'s rule and
bits (the merge runs without floating-point contraction, as the quantize kernel does, so its values do
not depend on which of the two quantizes them).

Both read KV position ``p`` of sequence ``s`` at block ``block_tables[s, p // block_size]``, slot
``p % block_size``, and mask every position past the row's own: entries beyond a sequence's blocks
are never loaded. Scores, softmax and sums are float32 whatever the cache dtype."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from oxibonsai.torch_backend import batch
from oxibonsai.torch_backend.ops import pdl
from oxibonsai.torch_backend.ops.ahead import QuantizeNext
from oxibonsai.torch_backend.ops.pdl import grid_dependency
from oxibonsai.torch_backend.ops.q1_exact import (
    NO_FUSION,
    QK,
    QuantizedRows,
    device_counters,
    linear_quantized,
    linear_then_quantize,
    quantize,
)
from oxibonsai.torch_backend.ops.q1_exact_kernels import _last_to_arrive, _store_block
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight
from oxibonsai.torch_backend.ops.rope_kv_triton import (
    _angles,
    _norm_rope,
    _write_kv_heads,
    qk_norm_rope_write_kv,
)

PRECISIONS = ("ieee", "tf32")  # tl.dot's: exact float32 (FMAs), or tensor cores on inputs rounded to tf32
GPU_PRECISION = "tf32"  # the default on CUDA: "ieee" needs 255 registers and spills in prefill (sm_90)
DECODE_BLOCK_N = 32  # KV positions per decode tile
PREFILL_BLOCK_M = 32  # packed (query, head) rows per prefill tile
PREFILL_BLOCK_N = 32  # KV positions per prefill tile
MERGE_MAX_ROWS = 8  # decode rows up to which the decode kernel merges its splits itself
MERGE_COUNTS = 1024  # (decode row, KV head) pairs a decode launch that merges its splits may count
FUSE_MERGE_ENV_VAR = "OXIBONSAI_FUSE_MERGE"
FUSE_ROPE_ENV_VAR = "OXIBONSAI_FUSE_ROPE"


@dataclass(frozen=True)
class RopeKv:
    """A layer's QKV rows before their QK-norm, RoPE and K/V write (``qk_norm_rope_write_kv``'s
    arguments), standing for the q they give: the attention's decode kernel does that work itself in a
    decode step of one row per sequence (module doc), and ``q()`` runs the kernel otherwise."""

    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cos_sin: torch.Tensor
    q_heads: int
    eps: float

    @property
    def shape(self) -> tuple[int, int, int]:
        """The q's: ``[T, Hq, D]``."""
        head_dim = self.q_norm.shape[0]
        return self.qkv.shape[0], self.q_heads, head_dim

    @property
    def device(self) -> torch.device:
        return self.qkv.device

    def q(self) -> torch.Tensor:
        """The normed, rotated q (float32 ``[T, Hq, D]``), K and V written: the launch of its own."""
        return qk_norm_rope_write_kv(
            self.qkv, self.q_norm, self.k_norm, self.positions, self.k_cache, self.v_cache,
            self.slot_mapping, q_heads=self.q_heads, cos_sin=self.cos_sin, eps=self.eps,
        )  # fmt: skip


def as_q(q: torch.Tensor | RopeKv) -> torch.Tensor:
    """``q`` itself, or a ``RopeKv``'s q computed (its K and V written)."""
    return q.q() if isinstance(q, RopeKv) else q


def fuses_rope(q: torch.Tensor | RopeKv, decode_rows: int, max_q_len: int | None) -> bool:
    """Whether the decode kernel does ``q``'s QK-norm, RoPE and K/V write: a ``RopeKv`` whose rows are all
    decode rows, at most one a sequence (then no other program reads a row's new position), with
    128-wide heads (the halves join into the kernel's head tile), unless ``OXIBONSAI_FUSE_ROPE=0``."""
    if not isinstance(q, RopeKv) or os.environ.get(FUSE_ROPE_ENV_VAR, "1").strip() == "0":
        return False
    tokens, _, head_dim = q.shape
    return tokens == decode_rows and max_q_len == 1 and head_dim == QK


@triton.jit
def _load_kv(
    cache_ptr, table_ptr, pos, valid, kv_head, offs_d, mask_d,
    stride_b, stride_s, stride_h,
    PAGE: tl.constexpr,
):  # fmt: skip
    """float32 ``[len(pos), BLOCK_D]`` of one KV head at positions ``pos``; 0 where not ``valid``."""
    block = tl.load(table_ptr + pos // PAGE, mask=valid, other=0).to(tl.int64)
    rows = block * stride_b + (pos % PAGE) * stride_s + kv_head * stride_h
    ptrs = cache_ptr + rows[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _online_softmax_step(scores, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one tile of (masked, -inf) scores and its values into the running max, sum and output."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _sequence_rows(qsl_ptr, seq_lens_ptr, decode_from_ptr, seq):
    """Sequence ``seq``'s rows: (first, first decode row, end, KV length after its last row)."""
    row0 = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    kv_len = tl.load(seq_lens_ptr + seq)
    prompt = tl.load(decode_from_ptr + seq) - (kv_len - (end - row0))  # prompt rows among the new
    return row0, row0 + tl.minimum(tl.maximum(prompt, 0), end - row0), end, kv_len


@triton.jit
def _decode_row(decode_rows_ptr, qsl_ptr, seq_lens_ptr, item):
    """Decode item ``item``: (its row, its sequence, the row's KV length: its position + 1)."""
    row = tl.load(decode_rows_ptr + 2 * item)
    seq = tl.load(decode_rows_ptr + 2 * item + 1)
    kv_len = tl.load(seq_lens_ptr + seq) - (tl.load(qsl_ptr + seq + 1) - 1 - row)
    return row, seq, kv_len


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, decode_rows_ptr, mid_o_ptr,
    mid_lse_ptr, scale, head_dim,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    stride_mt, stride_mh, stride_ms,
    GROUP: tl.constexpr, PAGE: tl.constexpr, MAX_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    out_ptr=None, planes_ptr=None, scales_ptr=None, sums_ptr=None, counts_ptr=None,
    stride_ot=0, stride_oh=0, stride_pp=0, stride_pm=0, stride_sm=0,
    MERGE: tl.constexpr = False, QUANTIZE: tl.constexpr = False, FENCE: tl.constexpr = False,
    q_norm_ptr=None, k_norm_ptr=None, positions_ptr=None, slots_ptr=None, cos_sin_ptr=None,
    q_heads=0, eps=0.0, stride_cs=0, ROPE: tl.constexpr = False, BLOCK_HALF: tl.constexpr = 1,
):  # fmt: skip
    """Partial output and log-sum-exp of split ``program_id(2)`` for the heads of one KV head, for
    decode item ``program_id(0)``; with ``MERGE`` the program that stores the last split of the item
    and KV head also merges its heads (``_merge_when_last``: the arguments after ``PDL``). With
    ``ROPE`` ``q_ptr`` is the QKV rows (``stride_qt``; ``stride_qh`` is ``head_dim``) and the program
    computes its q heads and, where its split holds the row's new position, stores its K and V first
    (``_rope_q``: the arguments after ``FENCE``)."""
    grid_dependency(PDL)
    item, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row, seq, kv_len = _decode_row(decode_rows_ptr, qsl_ptr, seq_lens_ptr, item)
    per_split = tl.cdiv(tl.cdiv(kv_len, MAX_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    mask_h = tl.arange(0, BLOCK_H) < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    if ROPE:
        q = _rope_q(
            q_ptr, k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr, positions_ptr, slots_ptr, cos_sin_ptr,
            row, kv_head, kv_len, start, end, q_heads, head_dim, eps, stride_qt, stride_cs,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            GROUP, PAGE, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip
    else:
        q_ptrs = q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_ptr = tables_ptr + seq * stride_table
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = _load_kv(k_cache_ptr, table_ptr, pos, valid, kv_head, offs_d, mask_d,
                     stride_kb, stride_ks, stride_kh, PAGE)  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        v = _load_kv(v_cache_ptr, table_ptr, pos, valid, kv_head, offs_d, mask_d,
                     stride_vb, stride_vs, stride_vh, PAGE)  # fmt: skip
        m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, PRECISION)
    nonempty = l_i > 0
    sums = tl.where(nonempty, l_i, 1.0)  # an empty split has l_i = 0 and acc = 0
    out = acc / sums[:, None]
    lse = tl.where(nonempty, m_i + tl.log(sums), float("-inf"))  # weight 0 in the merge
    mid = row * stride_mt + heads * stride_mh + split * stride_ms
    tl.store(mid_o_ptr + mid[:, None] + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(mid_lse_ptr + mid // head_dim, lse, mask=mask_h)  # mid_lse is mid_o without its last axis
    if MERGE:
        _merge_when_last(
            mid_o_ptr, mid_lse_ptr, out_ptr, planes_ptr, scales_ptr, sums_ptr, counts_ptr, row, item, kv_head,
            head_dim, stride_mt, stride_mh, stride_ms, stride_ot, stride_oh, stride_pp, stride_pm, stride_sm,
            GROUP, MAX_SPLITS, BLOCK_D, QUANTIZE, FENCE,
        )  # fmt: skip


@triton.jit
def _rope_q(
    qkv_ptr, k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr, positions_ptr, slots_ptr, cos_sin_ptr,
    row, kv_head, kv_len, start, end, q_heads, head_dim, eps, stride_qkv, stride_cs,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """The ``GROUP`` q heads of ``kv_head`` for QKV row ``row``, normed and rotated as
    ``rope_kv_triton``'s kernel does (float32 ``[BLOCK_H, 2 * BLOCK_HALF]``, the halves joined); when
    the split ``[start, end)`` holds the row's new position (``kv_len - 1``) and its slot is not -1,
    the row's K (normed, rotated) and V for ``kv_head`` stored there first, visible to the program's
    loads after a barrier."""
    row = row.to(tl.int64)
    half = head_dim // 2
    offs, mask_half, cos, sin = _angles(cos_sin_ptr, positions_ptr, row, stride_cs, half, BLOCK_HALF)
    qkv_row = qkv_ptr + row * stride_qkv
    offs_h = tl.arange(0, BLOCK_H)
    mask_q = (offs_h[:, None] < GROUP) & mask_half[None, :]
    first = qkv_row + kv_head * GROUP * head_dim
    lo, hi = _norm_rope(first, q_norm_ptr, offs_h, offs, mask_q, half, head_dim, eps, cos, sin, BLOCK_HALF)
    slot = tl.load(slots_ptr + row)
    if (start <= kv_len - 1) & (kv_len - 1 < end) & (slot >= 0):
        one = tl.arange(0, 2)  # a tile of one head (Triton's ranges are at least 2 wide here)
        mask_k = (one[:, None] < 1) & mask_half[None, :]
        _write_kv_heads(
            qkv_row, k_norm_ptr, k_cache_ptr, v_cache_ptr, slot, kv_head, one, offs, mask_k, q_heads,
            tl.num_programs(1), half, head_dim, eps, cos, sin, stride_kb, stride_ks, stride_kh, stride_vb,
            stride_vs, stride_vh, PAGE, BLOCK_HALF,
        )  # fmt: skip
        tl.debug_barrier()  # the stores are visible to every thread's loads of the position
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [BLOCK_H, 2 * BLOCK_HALF])


@triton.jit
def _merge_when_last(
    mid_o_ptr, mid_lse_ptr, out_ptr, planes_ptr, scales_ptr, sums_ptr, counts_ptr, row, item, kv_head,
    head_dim, stride_mt, stride_mh, stride_ms, stride_ot, stride_oh, stride_pp, stride_pm, stride_sm,
    GROUP: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZE: tl.constexpr,
    FENCE: tl.constexpr,
):  # fmt: skip
    """Called by each split program of a merging decode launch once its partial results are stored:
    the program that stores the last split of its item and KV head, whichever it is, merges the
    ``GROUP`` heads of that KV head (``_merge_head``, as ``_merge_kernel`` would in a launch of its
    own). Each program adds one to ``counts[item, kv_head]``; the one that brings it to the splits
    resets it to 0 for the next launch. ``FENCE`` as in ``q1_exact_kernels._quantize_when_last``; the
    partial results load from L2."""
    if _last_to_arrive(counts_ptr + item * tl.num_programs(1) + kv_head, MAX_SPLITS, FENCE):
        for h in range(GROUP):
            _merge_head(mid_o_ptr, mid_lse_ptr, out_ptr, planes_ptr, scales_ptr, sums_ptr, row,
                        kv_head * GROUP + h, head_dim, stride_mt, stride_mh, stride_ms, stride_ot, stride_oh,
                        stride_pp, stride_pm, stride_sm, MAX_SPLITS, BLOCK_D, QUANTIZE, ".cg")  # fmt: skip


@triton.jit
def _merge_kernel(
    mid_o_ptr, mid_lse_ptr, decode_rows_ptr, out_ptr, planes_ptr, scales_ptr, sums_ptr,
    head_dim, stride_mt, stride_mh, stride_ms, stride_ot, stride_oh, stride_pp, stride_pm, stride_sm,
    MAX_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """``_merge_head`` for decode item ``program_id(0)``, head ``program_id(1)``."""
    grid_dependency(PDL)
    item, head = tl.program_id(0), tl.program_id(1)
    row = tl.load(decode_rows_ptr + 2 * item)
    _merge_head(mid_o_ptr, mid_lse_ptr, out_ptr, planes_ptr, scales_ptr, sums_ptr, row, head, head_dim,
                stride_mt, stride_mh, stride_ms, stride_ot, stride_oh, stride_pp, stride_pm, stride_sm,
                MAX_SPLITS, BLOCK_D, QUANTIZE, "")  # fmt: skip


@triton.jit
def _merge_head(
    mid_o_ptr, mid_lse_ptr, out_ptr, planes_ptr, scales_ptr, sums_ptr, row, head, head_dim,
    stride_mt, stride_mh, stride_ms, stride_ot, stride_oh, stride_pp, stride_pm, stride_sm,
    MAX_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZE: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """``out[row, head]`` from its ``MAX_SPLITS`` partial results (loaded with cache modifier ``CACHE``),
    weighted by their log-sum-exp; with ``QUANTIZE`` (``head_dim`` 128: one head is one block of the O
    projection's activations) that block of the row quantized into ``q1_exact.QuantizedRows`` instead.
    The splits are taken one after another, each an elementwise step, so the bits do not depend on how
    the kernel that runs this lays its tiles out (the decode kernel's own merge and the merge kernel
    give the same)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    first = row * stride_mt + head * stride_mh
    lses = ()
    for s in tl.static_range(MAX_SPLITS):
        lse = tl.load(mid_lse_ptr + (first + s * stride_ms) // head_dim, cache_modifier=CACHE)
        lses = lses + (lse,)  # noqa: RUF005 (Triton's frontend: no starred tuples)
    top = lses[0]  # split 0 is never empty: the max is finite
    for s in tl.static_range(1, MAX_SPLITS):
        top = tl.maximum(top, lses[s])
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = 0.0
    for s in tl.static_range(MAX_SPLITS):
        weight = tl.exp(lses[s] - top)  # an empty split's: 0
        at = mid_o_ptr + first + s * stride_ms + offs_d
        part = tl.load(at, mask=mask_d, other=0.0, cache_modifier=CACHE)
        acc = acc + weight * part
        total = total + weight
    out = acc / total
    if QUANTIZE:
        _store_block(out, planes_ptr, scales_ptr, sums_ptr, row, head, stride_pp, stride_pm, stride_sm)
    else:
        tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, out, mask=mask_d)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, decode_from_ptr, out_ptr,
    scale, head_dim,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, PAGE: tl.constexpr, Q_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Causal attention of ``Q_PER_TILE`` prompt rows (times ``GROUP`` heads) of one sequence."""
    grid_dependency(PDL)
    seq, tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0, first_decode, end, kv_len = _sequence_rows(qsl_ptr, seq_lens_ptr, decode_from_ptr, seq)
    prompt_rows = first_decode - row0
    q_first = tile * Q_PER_TILE
    if q_first < prompt_rows:  # the decode kernel takes the rest
        first_pos = kv_len - (end - row0)
        r = tl.arange(0, BLOCK_M)
        q_idx = q_first + r // GROUP
        valid_r = (r < Q_PER_TILE * GROUP) & (q_idx < prompt_rows)
        pos_r = first_pos + tl.where(valid_r, q_idx, q_first)  # padding rows copy the first row
        heads = kv_head * GROUP + r % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        q_rows = (row0 + q_idx) * stride_qt + heads * stride_qh
        q = tl.load(
            q_ptr + q_rows[:, None] + offs_d[None, :], mask=valid_r[:, None] & mask_d[None, :], other=0.0
        )
        q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table_ptr = tables_ptr + seq * stride_table
        kv_end = first_pos + tl.minimum(q_first + Q_PER_TILE, prompt_rows)  # past the tile's last row
        for tile_kv in range(0, kv_end, BLOCK_N):
            pos = tile_kv + tl.arange(0, BLOCK_N)
            valid = pos < kv_end
            k = _load_kv(k_cache_ptr, table_ptr, pos, valid, kv_head, offs_d, mask_d,
                         stride_kb, stride_ks, stride_kh, PAGE)  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(pos[None, :] <= pos_r[:, None], scores, float("-inf"))
            v = _load_kv(v_cache_ptr, table_ptr, pos, valid, kv_head, offs_d, mask_d,
                         stride_vb, stride_vs, stride_vh, PAGE)  # fmt: skip
            m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, PRECISION)
        out_rows = (row0 + q_idx) * stride_ot + heads * stride_oh
        out_ptrs = out_ptr + out_rows[:, None] + offs_d[None, :]
        tl.store(out_ptrs, acc / l_i[:, None], mask=valid_r[:, None] & mask_d[None, :])


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
    max_splits: int | None = None,
    precision: str | None = None,
) -> torch.Tensor:
    """Causal paged attention, float32 ``[T, Hq, D]`` (see ``ref_torch.paged_attention``; a row no
    sequence owns is left unwritten here, not zeroed: runners' steps have none). ``q`` may be a
    ``RopeKv``, whose kernel then runs first.
    ``decode_from`` (int32 ``[S]``) picks each row's kernel (module doc); by default
    ``batch.default_decode_from``'s rule. ``decode_rows`` (int32
    ``[D, 2]``, ``batch.decode_rows`` of the same plan) and ``max_q_len``, which runners take from the
    host's plan, spare device syncs; with no decode rows the decode kernels do not launch, with only
    decode rows the prefill kernel does not. ``max_splits`` (a power of 2) fixes the decode kernel's KV
    splits: 16 on a GPU, 2 in the interpreter. ``precision`` (one of ``PRECISIONS``) picks the dots:
    ``GPU_PRECISION`` on CUDA, "ieee" elsewhere."""
    q, precision, splits, rows = _setup(
        as_q(q), k_cache, v_cache, (block_tables, seq_lens, query_start_loc, decode_from, decode_rows),
        precision, max_splits,
    )  # fmt: skip
    # Every row is written by exactly one kernel (its decode_rows entry or its sequence's prompt rows):
    # no fill launch (one per layer and step) is needed.
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if rows.decode_rows.shape[0]:
        _decode(q, k_cache, v_cache, rows, scale, out, splits, precision)
    if rows.decode_rows.shape[0] < q.shape[0]:
        if max_q_len is None:  # a device sync: runners pass it from the plan, which the host already has
            q_lens = query_start_loc[1:] - query_start_loc[:-1]
            max_q_len = int(q_lens.max()) if q_lens.numel() else 0
        _prefill(q, k_cache, v_cache, rows, scale, out, max_q_len, precision)
    return out


def quantized_attention(
    q: torch.Tensor | RopeKv,
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
    max_splits: int | None = None,
    precision: str | None = None,
) -> QuantizedRows:
    """``q1_exact.quantize(paged_attention(...).reshape(T, Hq * D))``, the activations of the O
    projection, with the same bits: when every row is a decode row (a decode step) and ``D`` is 128,
    the merge kernel quantizes each head's output itself (one launch per layer fewer, and no float
    output); otherwise the attention output is quantized after. Every row must be some sequence's.
    A ``RopeKv`` q's QK-norm, RoPE and K/V write run in the decode kernel where ``fuses_rope``, in their
    own launch first otherwise."""
    tokens, q_heads, head_dim = q.shape
    rows_known = decode_rows is not None and decode_rows.shape[0] == tokens
    if not fuses_rope(q, tokens if rows_known else -1, max_q_len):
        q = as_q(q)
    if not rows_known or head_dim != QK or tokens == 0:
        out = paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, decode_from=decode_from,
            decode_rows=decode_rows, max_q_len=max_q_len, max_splits=max_splits, precision=precision,
        )  # fmt: skip
        return quantize(out.reshape(tokens, q_heads * head_dim))
    q, precision, splits, rows = _setup(
        q, k_cache, v_cache, (block_tables, seq_lens, query_start_loc, decode_from, decode_rows),
        precision, max_splits,
    )  # fmt: skip
    acts = QuantizedRows.empty(tokens, q_heads * head_dim, q.device)
    _decode(q, k_cache, v_cache, rows, scale, acts, splits, precision)
    return acts


def attention_linear(
    q: torch.Tensor | RopeKv,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    w: Q1Weight,
    *,
    residual: torch.Tensor | None = None,
    **hints: Any,
) -> torch.Tensor:
    """``ref_torch.attention_linear`` in the exact arithmetic: the O projection of
    ``quantized_attention``'s rows (in a decode step, quantized by the merge kernel)."""
    out, _ = attention_linear_ahead(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, w, residual=residual, **hints
    )
    return out


def attention_linear_ahead(
    q: torch.Tensor | RopeKv,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    w: Q1Weight,
    *,
    residual: torch.Tensor | None = None,
    then: QuantizeNext | None = None,
    **hints: Any,
) -> tuple[torch.Tensor, QuantizedRows | None]:
    """``attention_linear`` with its output quantized ahead for the next matmul as ``then`` asks
    (``ops.ahead``; None without ``then``)."""
    tokens, width = q.shape[0], q.shape[1] * q.shape[2]
    if w.cols != width or (residual is not None and residual.shape != (tokens, w.rows)):
        raise ValueError(
            f"W [{w.rows}, {w.cols}] and residual {None if residual is None else list(residual.shape)} "
            f"do not fit attention rows [{tokens}, {width}]"
        )
    acts = quantized_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **hints)
    if then is None:
        return linear_quantized(acts, w, residual=residual), None
    return linear_then_quantize(acts, w, then, residual=residual)


class _Rows:
    """The plan tensors the kernels read, with the defaults of ``decode_from`` and ``decode_rows``
    filled in through the host (a device sync)."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        decode_from: torch.Tensor | None,
        decode_rows: torch.Tensor | None,
    ) -> None:
        self.tables, self.seq_lens, self.starts = block_tables, seq_lens, query_start_loc
        if decode_from is not None and decode_from.shape != seq_lens.shape:
            raise ValueError(f"decode_from needs one entry per sequence: {decode_from.shape}")
        if decode_from is None or decode_rows is None:
            starts, lens = query_start_loc.cpu().numpy(), seq_lens.cpu().numpy()
            if decode_from is None:
                decode_from = torch.from_numpy(batch.default_decode_from(starts, lens)).to(seq_lens.device)
            if decode_rows is None:
                rows = batch.decode_rows(starts, lens, decode_from.cpu().numpy())
                decode_rows = torch.from_numpy(rows).to(seq_lens.device)
        self.decode_from, self.decode_rows = decode_from, decode_rows

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def _decode(
    q: torch.Tensor | RopeKv,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: _Rows,
    scale: float,
    out: torch.Tensor | QuantizedRows,
    splits: int,
    precision: str,
) -> None:
    """The decode rows' attention into ``out``: float32 ``[T, Hq, D]``, or quantized rows ``[T, Hq * D]``
    (``D`` = 128); from a ``RopeKv``'s QKV rows, its work in the same kernel."""
    tokens, q_heads, head_dim = q.shape
    kv_heads, group = k_cache.shape[2], q_heads // k_cache.shape[2]
    mid_o = torch.empty(tokens, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(tokens, q_heads, splits, dtype=torch.float32, device=q.device)
    items = rows.decode_rows.shape[0]
    quantize = isinstance(out, QuantizedRows)
    planes, scales, sums = (out.planes, out.scales, out.sums) if quantize else (mid_o, mid_lse, mid_lse)
    float_out = mid_o if quantize else out
    # Contraction off in both kernels: the merged values are the same bits whether it quantizes them or
    # q1_exact.quantize does (whose kernel runs without contraction too), and whichever kernel merges
    # (a row's bits never depend on the batch's size).
    merging = merges_in_decode(items, kv_heads)
    merge = dict(
        out_ptr=float_out, planes_ptr=planes, scales_ptr=scales, sums_ptr=sums,
        counts_ptr=merge_counts(q.device), stride_ot=float_out.stride(0), stride_oh=float_out.stride(1),
        stride_pp=planes.stride(0), stride_pm=planes.stride(1), stride_sm=scales.stride(0),
        MERGE=True, QUANTIZE=quantize, FENCE=_on_gpu(q.device),
    ) if merging else {}  # fmt: skip
    q_rows, rope = (q.qkv, _rope_args(q)) if isinstance(q, RopeKv) else (q, {})
    _decode_kernel[(items, kv_heads, splits)](
        q_rows, k_cache, v_cache, rows.tables, rows.seq_lens, rows.starts, rows.decode_rows, mid_o, mid_lse,
        scale, head_dim,
        q_rows.stride(0), head_dim if rope else q_rows.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], rows.tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        GROUP=group, PAGE=k_cache.shape[1], MAX_SPLITS=splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=_block_d(head_dim),
        BLOCK_N=DECODE_BLOCK_N, PRECISION=precision, **merge, **rope, **pdl.launch(q.device), **NO_FUSION,
    )  # fmt: skip
    if merging:
        return
    _merge_kernel[(items, q_heads)](
        mid_o, mid_lse, rows.decode_rows, float_out, planes, scales, sums,
        head_dim, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), float_out.stride(0),
        float_out.stride(1), planes.stride(0), planes.stride(1), scales.stride(0),
        MAX_SPLITS=splits, BLOCK_D=_block_d(head_dim), QUANTIZE=quantize, **pdl.launch(q.device), **NO_FUSION,
    )  # fmt: skip


def _rope_args(rope: RopeKv) -> dict[str, Any]:
    """The decode kernel's arguments for doing ``rope``'s work (``ROPE``)."""
    return dict(
        q_norm_ptr=rope.q_norm, k_norm_ptr=rope.k_norm, positions_ptr=rope.positions,
        slots_ptr=rope.slot_mapping, cos_sin_ptr=rope.cos_sin, q_heads=rope.q_heads, eps=float(rope.eps),
        stride_cs=rope.cos_sin.stride(0), ROPE=True, BLOCK_HALF=rope.shape[2] // 2,
    )  # fmt: skip


def merges_in_decode(rows: int, kv_heads: int) -> bool:
    """Whether the decode kernel merges its splits itself (``_merge_when_last``) for ``rows`` decode
    rows: up to ``MERGE_MAX_ROWS`` (where launches dominate a step; the merge takes the kernel from 96
    to 128 registers under Triton 3.6, sm_90, fewer programs an SM for the larger batches) and where
    ``merge_counts`` holds their counters. ``OXIBONSAI_FUSE_MERGE=0``: never (a merge launch of its
    own, as before); ``=all``: wherever the counters hold them (for timing the larger batches on a GPU:
    the bits are the same either way)."""
    fits = rows * kv_heads <= MERGE_COUNTS
    choice = os.environ.get(FUSE_MERGE_ENV_VAR, "1").strip()
    if choice not in ("0", "1", "all"):
        raise ValueError(f"{FUSE_MERGE_ENV_VAR} must be 0, 1 or all, got {choice!r}")
    return fits and (choice == "all" or (choice == "1" and rows <= MERGE_MAX_ROWS))


def merge_counts(device: torch.device) -> torch.Tensor:
    """The zeroed counters a merging decode launch counts each (row, KV head)'s finished splits in, one
    set per device, back at zero after each launch (as ``q1_exact.arrival_counts``)."""
    return device_counters(device, "attention merges", MERGE_COUNTS)


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: _Rows,
    scale: float,
    out: torch.Tensor,
    max_q_len: int,
    precision: str,
) -> None:
    head_dim = q.shape[2]
    kv_heads, group = k_cache.shape[2], q.shape[1] // k_cache.shape[2]
    block_m = max(PREFILL_BLOCK_M, triton.next_power_of_2(group))
    q_per_tile = block_m // group
    grid = (rows.num_seqs, triton.cdiv(max_q_len, q_per_tile), kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, rows.tables, rows.seq_lens, rows.starts, rows.decode_from, out,
        scale, head_dim,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], rows.tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, PAGE=k_cache.shape[1], Q_PER_TILE=q_per_tile,
        BLOCK_M=block_m, BLOCK_D=_block_d(head_dim), BLOCK_N=PREFILL_BLOCK_N, PRECISION=precision,
        num_warps=4 if precision == "ieee" else 8,  # sm_90: tf32 spills nothing at 8, ieee less at 4
        **pdl.launch(q.device),
    )  # fmt: skip


def _setup(
    q: torch.Tensor | RopeKv,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    precision: str | None,
    splits: int | None,
) -> tuple[torch.Tensor | RopeKv, str, int, _Rows]:
    """``q`` checked, the dots' precision and the decode kernel's KV splits (the arguments, checked, or
    the device's defaults: see ``paged_attention``), and the plan's rows (``plan``: block tables, KV
    lengths, query starts, ``decode_from``, ``decode_rows``)."""
    q = _check(q, k_cache, v_cache)
    device = q.device
    precision = precision or (GPU_PRECISION if _on_gpu(device) else "ieee")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    splits = splits or (16 if _on_gpu(device) else 2)
    if splits & (splits - 1):
        raise ValueError(f"max_splits must be a power of 2, got {splits}")
    return q, precision, splits, _Rows(*plan)


def _on_gpu(device: torch.device) -> bool:
    """Whether the kernels run compiled on a GPU (else in the interpreter); the defaults follow it."""
    return device.type == "cuda"


def _block_d(head_dim: int) -> int:
    return max(16, int(triton.next_power_of_2(head_dim)))


def _check(q: torch.Tensor | RopeKv, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | RopeKv:
    """``q`` with a unit last stride, after checking the shapes the kernels assume."""
    if len(q.shape) != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"need q [T, Hq, D] and caches [B, block, Hkv, D]: {q.shape}, {k_cache.shape}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"q {list(q.shape)} does not fit caches {list(k_cache.shape)}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' last dimension must be contiguous")
    if isinstance(q, RopeKv):
        same = [
            (a.data_ptr(), a.shape) == (b.data_ptr(), b.shape)
            for a, b in ((q.k_cache, k_cache), (q.v_cache, v_cache))
        ]
        if q.qkv.stride(1) != 1 or not all(same):
            raise ValueError("a RopeKv needs QKV rows of unit column stride, and the attention's caches")
        return q
    return q if q.stride(2) == 1 else q.contiguous()

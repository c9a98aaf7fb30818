"""Exact-integer Q1_0 linear layers for the GPU: the CPU engine's arithmetic, bit for bit, at every
batch size.

Activations are quantized per 128 values exactly as the Rust core does (``rust/core/src/q1/act.rs``:
int16 values whose block L1 norm stays within 32639, one float32 scale and one integer sum per block).
Each block's signed sum ``sum_j s_j q_j`` is then an integer, computed exactly, and the blocks are
combined in order, ``acc = fma(float(isum), d_w * d_a, acc)`` from block 0, like every CPU kernel. So:

- a row's output never depends on the other rows of the batch, on the kernel (GEMV or GEMM) or on its
  tiles: greedy tokens batched and alone go through the same bits, and a CUDA graph's padded bucket
  changes nothing;
- the output equals ``oxibonsai.Q1Matrix.matmul`` on the same activations (the tests check it bit for
  bit under Triton's interpreter).

The int16 values travel as two planes of signed bytes (``q = 256 * high + low``, the split the CPU's
VNNI and AMX kernels use), stored so that each int32 word holds the four values a ``dp4a`` pairs with
one weight word's bits ``j, j + 8, j + 16, j + 24`` (``(word >> j) & 0x01010101`` in byte lanes).

- ``quantize``: one program per activation row, the RMSNorm before the matmul folded in.
- the GEMV (``M <= GEMV_MAX_M``): one weight row per thread lane and every activation row in the same
  thread, no reduction across threads: per sign word, 8 shift-and-mask operations expose 4 weights
  each, and per activation row two ``dp4a`` (high and low plane) add them; about 1.4 SASS instructions
  per weight at one row (``benches/gpu/sass.py``). ``ASM`` picks the inline-PTX ``dp4a`` or its
  plain-Triton twin, which gives the same integers and runs in the interpreter. A matrix with too few
  rows to fill the GPU splits K: for one activation row inside each program (``_gemv_one_row_kernel``:
  the lanes store each group's integer sums, a barrier, then the program adds the groups in order),
  for more over programs with a second kernel adding the groups (``_combine_kernel``). The SwiGLU of a
  gate|up matrix and the residual add run in the program that adds the groups.
- the GEMM (larger M, prefill): each sign word becomes a 32 x BLOCK_N tile of 0/1 bytes and both
  planes go through int8 ``tl.dot`` (integer tensor cores on a GPU, exact), gate and up rows of a
  gate|up matrix in the same program, the epilogue in the same code as the GEMV's (``_finish``).

Kernels launch with floating-point contraction off (``enable_fp_fusion=False``): every rounding is the
one written, and the CPU's fused multiply-add is an explicit ``tl.fma``."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from oxibonsai.torch_backend.ops.q1_triton import check_fused, gemm_block_m, multiprocessors
from oxibonsai.torch_backend.ops.q1_weight import QK, Q1Weight

GEMV_MAX_M = 8
KERNELS = ("gemv", "gemv1", "gemm")
GEMM_BLOCK_N = 64  # weight rows of a GEMM tile (32 and 32 for gate|up)
ONE_ROW_TILE = 256  # splits x weight rows of a one-row GEMV program: one pair per thread, 8 warps
PROGRAMS_PER_SM = 4  # the GEMV splits K until it has this many 4-warp programs per SM
L1_FIXED = tl.constexpr(65536.0)  # act.rs: fixed-point resolution of the L1 estimate
L1_BUDGET = tl.constexpr(32575.0)  # act.rs: the L1 budget a block's scale targets
MIN_AMAX = tl.constexpr(2.0**-96)  # act.rs: blocks whose largest magnitude is below this quantize to 0
FLT_MAX = tl.constexpr(3.4028234663852886e38)
NAN = tl.constexpr(float("nan"))
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + ROUND) - ROUND rounds |v| < 2^22 half to even
LANES = tl.constexpr(0x01010101)
NO_FUSION = {"enable_fp_fusion": False}


@dataclass(frozen=True)
class QuantizedRows:
    """``M`` activation rows quantized per 128 values (``act.rs``'s rule)."""

    planes: torch.Tensor  # int8 [2, padded_rows(M), K]: high then low bytes of q, 32 columns in dp4a order
    scales: torch.Tensor  # float32 [M, K / 128]; NaN for a block with a non-finite value
    sums: torch.Tensor  # int32 [M, K / 128]: each block's sum of q

    @property
    def rows(self) -> int:
        return int(self.scales.shape[0])

    def values(self) -> torch.Tensor:
        """int32 ``[M, K]`` of q in column order (tests and oracles only)."""
        m, k = self.rows, self.planes.shape[2]
        q = self.planes[0, :m].to(torch.int32) * 256 + self.planes[1, :m].to(torch.int32)
        return q.reshape(m, k // 32, 8, 4).transpose(2, 3).reshape(m, k)


@triton.jit
def _quantize_kernel(
    x_ptr, norm_ptr, planes_ptr, scales_ptr, sums_ptr,
    K, eps,
    stride_xm, stride_pp, stride_pm, stride_sm,
    NORM: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)`` of ``x`` (times its RMSNorm when ``NORM``) into ``QuantizedRows``."""
    m = tl.program_id(0)
    cols = tl.arange(0, 128)
    row = x_ptr + m * stride_xm
    rstd = 1.0
    if NORM:
        squares = tl.zeros([128], dtype=tl.float32)
        for b in range(K // 128):
            v = tl.load(row + b * 128 + cols).to(tl.float32)
            squares += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(squares) / K + eps)
    # column 32c + 8i + j goes to byte 32c + 4j + i: word 8c + j, lane i
    dest = (cols // 32) * 32 + (cols % 8) * 4 + (cols % 32) // 8
    for b in range(K // 128):
        x = tl.load(row + b * 128 + cols).to(tl.float32)
        if NORM:
            x = x * rstd * tl.load(norm_ptr + b * 128 + cols).to(tl.float32)
        q, scale = _quantize_block(x)
        low = (q << 24) >> 24
        high = (q - low) >> 8
        plane = planes_ptr + m * stride_pm + b * 128 + dest
        tl.store(plane, high.to(tl.int8))
        tl.store(plane + stride_pp, low.to(tl.int8))
        tl.store(scales_ptr + m * stride_sm + b, scale)
        tl.store(sums_ptr + m * stride_sm + b, tl.sum(q))


@triton.jit
def _quantize_block(x):
    """``act.rs``'s rule for one block: int32 ``q`` and the float32 scale (0 for a block below
    ``MIN_AMAX``, NaN for one with a non-finite value, whose q are 0)."""
    ax = tl.abs(x)
    finite = tl.sum((ax <= FLT_MAX).to(tl.int32)) == 128  # NaN compares false
    amax = tl.max(ax)
    used = finite & (amax >= MIN_AMAX)
    safe = tl.where(used, amax, 1.0)
    t = tl.sum(tl.floor(ax * tl.math.div_rn(L1_FIXED, safe)).to(tl.int32))
    scale = tl.math.div_rn((t + 128).to(tl.float32) * (safe * (1.0 / L1_FIXED)), L1_BUDGET)
    rounded = (x * tl.math.div_rn(1.0, scale) + ROUND) - ROUND
    q = tl.where(used, rounded, 0.0).to(tl.int32)
    scale = tl.where(used, scale, tl.where(finite, 0.0, NAN))
    return q, scale


@triton.jit
def _dot4(bits, acts, acc, ASM: tl.constexpr):
    """``acc + sum_i bits_i * acts_i`` over the four byte lanes (bits 0/1, acts signed bytes)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [bits, acts, acc],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        picked = acts & (bits * 255)  # a lane's byte where its bit is set, else 0
        lanes = ((picked << 24) >> 24) + ((picked << 16) >> 24) + ((picked << 8) >> 24) + (picked >> 24)
        return acc + lanes


@triton.jit
def _combine(acc, ones, block_sums, d_wa):
    """``fma(isum, d_w * d_a, acc)`` for one block: its exact signed sum ``2 * sum_{bit set} q - sum q``
    (``ones``: the sum over set bits) added with the CPU kernels' one rounding."""
    isum = 2 * ones - block_sums
    return tl.fma(isum.to(tl.float32), d_wa, acc)


@triton.jit
def _finish(y, up, residual, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
    """The epilogue every path shares: ``silu(gate) * up`` when ``GATED``, then ``+ residual``."""
    if GATED:
        y = y * tl.sigmoid(y) * up
    if RESIDUAL:
        y = y + residual
    return y


@triton.jit
def _ones(planes_ptr, signs_ptr, act_pairs, word_at, word_mask, stride_pp,
          R: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """int32 ``[R, BLOCK_N]``: ``sum q`` over the set bits of one 128-group, for the weight rows whose
    group starts at sign word ``word_at`` (``[1 or R, BLOCK_N]``, loaded where ``word_mask``) and the
    activation rows whose group starts at int64 ``act_pairs`` (``[R, 1]``) of the high plane, the low
    plane ``stride_pp`` words on (planes read two words a load)."""
    high = tl.zeros([R, BLOCK_N], dtype=tl.int32)
    low = tl.zeros([R, BLOCK_N], dtype=tl.int32)
    pairs = planes_ptr.to(tl.pointer_type(tl.int64))
    for w in tl.static_range(4):
        word = tl.load(signs_ptr + word_at + w, mask=word_mask, other=0)
        for p in tl.static_range(4):
            high2 = tl.load(pairs + act_pairs + w * 4 + p)
            low2 = tl.load(pairs + act_pairs + stride_pp // 2 + w * 4 + p)
            for half in tl.static_range(2):
                bits = (word >> (2 * p + half)) & LANES
                high = _dot4(bits, (high2 >> (32 * half)).to(tl.int32), high, ASM)
                low = _dot4(bits, (low2 >> (32 * half)).to(tl.int32), low, ASM)
    return high * 256 + low


@triton.jit
def _gemv_kernel(
    planes_ptr, ascales_ptr, asums_ptr, signs_ptr, wscales_ptr, residual_ptr, out_ptr, ones_ptr,
    M, N, K, up_offset, groups_per_split,
    stride_pp, stride_pm, stride_am, stride_sn, stride_dn, stride_rm, stride_om, stride_og, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Rows ``n`` of program ``program_id(0)`` for every activation row ``m``, ``planes`` read as int32
    words; with ``GATED`` also rows ``n + up_offset``. ``SPLIT``: the program covers the groups of
    split ``program_id(1)`` and stores each group's integer sums at ``ones[g, m, n]`` for
    ``_combine_kernel``; otherwise it covers every group, combines them and stores ``out[m, n]``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    first = tl.program_id(1) * groups_per_split
    last = tl.minimum(first + groups_per_split, K // 128)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(first, last):
        act_pairs = (offs_m * (stride_pm // 2) + g * 16)[:, None]  # the planes hold BLOCK_M rows
        word_at = (offs_n * stride_sn + g * 4)[None, :]
        words_mask = mask_n[None, :]
        ones = _ones(planes_ptr, signs_ptr, act_pairs, word_at, words_mask, stride_pp, BLOCK_M, BLOCK_N, ASM)
        ones_up = ones
        if GATED:
            up_at = word_at + up_offset * stride_sn
            ones_up = _ones(
                planes_ptr, signs_ptr, act_pairs, up_at, words_mask, stride_pp, BLOCK_M, BLOCK_N, ASM
            )
        if SPLIT:
            at = ones_ptr + g * stride_og + offs_m[:, None] * stride_on + offs_n[None, :]
            tl.store(at, ones, mask=mask_m[:, None] & mask_n[None, :])
            if GATED:
                tl.store(at + up_offset, ones_up, mask=mask_m[:, None] & mask_n[None, :])
        else:
            acc, acc_up = _combine_group(
                acc, acc_up, ones, ones_up, asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n,
                mask_n, g, up_offset, stride_am, stride_dn, GATED,
            )  # fmt: skip
    if not SPLIT:
        _store_out(acc, acc_up, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_rm, stride_om,
                   GATED, RESIDUAL)  # fmt: skip


@triton.jit
def _gemv_one_row_kernel(
    planes_ptr, ascales_ptr, asums_ptr, signs_ptr, wscales_ptr, residual_ptr, out_ptr, ones_ptr,
    N, K, up_offset, groups_per_split,
    stride_pp, stride_sn, stride_dn, stride_og,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """One activation row, rows ``n`` of program ``program_id(0)``, with K split inside the program: the
    ``[SPLITS, BLOCK_N]`` tile's row ``s`` takes groups ``s * groups_per_split`` onwards and stores each
    group's integer sums at ``ones[g, n]``; after a barrier the program adds every group in order. For
    matrices with too few rows to fill the GPU, one launch instead of the split GEMV's two."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    groups = K // 128
    split = tl.arange(0, SPLITS)[:, None]
    mask = (split < SPLITS) & mask_n[None, :]
    for j in range(groups_per_split):
        g = split * groups_per_split + j
        valid = mask & (g < groups)
        g = tl.minimum(g, groups - 1)  # past the end: a real group's loads, never stored
        word_at = offs_n[None, :] * stride_sn + g * 4
        at = ones_ptr + g * stride_og + offs_n[None, :]
        ones = _ones(planes_ptr, signs_ptr, g * 16, word_at, mask, stride_pp, SPLITS, BLOCK_N, ASM)
        tl.store(at, ones, mask=valid)
        if GATED:
            up_at = word_at + up_offset * stride_sn
            ones_up = _ones(planes_ptr, signs_ptr, g * 16, up_at, mask, stride_pp, SPLITS, BLOCK_N, ASM)
            tl.store(at + up_offset, ones_up, mask=valid)
    tl.debug_barrier()  # the program's stores are visible to all its threads
    offs_m = tl.arange(0, 1)
    mask_m = offs_m < 1
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for g in range(0, groups):
        at = ones_ptr + g * stride_og + offs_n[None, :]
        ones = tl.load(at, mask=mask_n[None, :], other=0)
        ones_up = ones
        if GATED:
            ones_up = tl.load(at + up_offset, mask=mask_n[None, :], other=0)
        acc, acc_up = _combine_group(
            acc, acc_up, ones, ones_up, asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n, mask_n,
            g, up_offset, 0, stride_dn, GATED,
        )  # fmt: skip
    _store_out(acc, acc_up, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, 0, 0, GATED, RESIDUAL)


@triton.jit
def _combine_group(
    acc, acc_up, ones, ones_up, asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n, mask_n,
    g, up_offset, stride_am, stride_dn, GATED: tl.constexpr,
):  # fmt: skip
    """``acc`` (and ``acc_up``) after group ``g``: ``[BLOCK_M, BLOCK_N]`` tiles."""
    block_sums = tl.load(asums_ptr + offs_m * stride_am + g, mask=mask_m, other=0)[:, None]
    d_a = tl.load(ascales_ptr + offs_m * stride_am + g, mask=mask_m, other=0.0)[:, None]
    d_w = tl.load(wscales_ptr + offs_n * stride_dn + g, mask=mask_n, other=0.0).to(tl.float32)
    acc = _combine(acc, ones, block_sums, d_w[None, :] * d_a)
    if GATED:
        d_up = tl.load(wscales_ptr + (offs_n + up_offset) * stride_dn + g, mask=mask_n, other=0.0)
        acc_up = _combine(acc_up, ones_up, block_sums, d_up.to(tl.float32)[None, :] * d_a)
    return acc, acc_up


@triton.jit
def _store_out(acc, acc_up, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_rm, stride_om,
               GATED: tl.constexpr, RESIDUAL: tl.constexpr):  # fmt: skip
    """``out[m, n] = _finish(acc, acc_up, residual[m, n])`` over a ``[BLOCK_M, BLOCK_N]`` tile."""
    mask = mask_m[:, None] & mask_n[None, :]
    residual = 0.0
    if RESIDUAL:
        residual = tl.load(residual_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
    y = _finish(acc, acc_up, residual, GATED, RESIDUAL)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)


@triton.jit
def _combine_kernel(
    ones_ptr, ascales_ptr, asums_ptr, wscales_ptr, residual_ptr, out_ptr,
    M, N, K, up_offset,
    stride_am, stride_dn, stride_rm, stride_om, stride_og, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The split GEMV's second half: every group's integer sums ``ones[g, m, n]`` combined in order, then
    the epilogue, for rows ``n`` of program ``program_id(0)``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    mask = mask_m[:, None] & mask_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, K // 128):
        at = ones_ptr + g * stride_og + offs_m[:, None] * stride_on + offs_n[None, :]
        ones = tl.load(at, mask=mask, other=0)
        ones_up = ones
        if GATED:
            ones_up = tl.load(at + up_offset, mask=mask, other=0)
        acc, acc_up = _combine_group(
            acc, acc_up, ones, ones_up, asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n, mask_n,
            g, up_offset, stride_am, stride_dn, GATED,
        )  # fmt: skip
    _store_out(acc, acc_up, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_rm, stride_om,
               GATED, RESIDUAL)  # fmt: skip


@triton.jit
def _gemm_kernel(
    planes_ptr, ascales_ptr, asums_ptr, signs_ptr, wscales_ptr, residual_ptr, out_ptr,
    M, N, K, up_offset,
    stride_pp, stride_pm, stride_am, stride_sn, stride_dn, stride_rm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
):  # fmt: skip
    """``out[m, n]`` for one ``BLOCK_M x BLOCK_N`` tile, the epilogue included: per sign word a 0/1 byte
    tile ``[32, BLOCK_N]`` in the planes' dp4a order and two int8 ``tl.dot``s; with ``GATED`` the up
    rows ``n + up_offset`` too, on the same activation tiles."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(K // 128):
        high = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        low = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        high_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        low_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for w in tl.static_range(4):
            acts = planes_ptr + offs_m[:, None] * stride_pm + g * 128 + w * 32 + tl.arange(0, 32)[None, :]
            a_high = tl.load(acts, mask=mask_m[:, None], other=0)
            a_low = tl.load(acts + stride_pp, mask=mask_m[:, None], other=0)
            bits = _bit_tile(signs_ptr, offs_n * stride_sn + g * 4 + w, mask_n)
            high = tl.dot(a_high, bits, high)
            low = tl.dot(a_low, bits, low)
            if GATED:
                bits_up = _bit_tile(signs_ptr, (offs_n + up_offset) * stride_sn + g * 4 + w, mask_n)
                high_up = tl.dot(a_high, bits_up, high_up)
                low_up = tl.dot(a_low, bits_up, low_up)
        acc, acc_up = _combine_group(
            acc, acc_up, high * 256 + low, high_up * 256 + low_up, asums_ptr, ascales_ptr, wscales_ptr,
            offs_m, mask_m, offs_n, mask_n, g, up_offset, stride_am, stride_dn, GATED,
        )  # fmt: skip
    _store_out(acc, acc_up, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_rm, stride_om,
               GATED, RESIDUAL)  # fmt: skip


@triton.jit
def _bit_tile(signs_ptr, word_at, mask_n):
    """int8 ``[32, BLOCK_N]``: the 0/1 bits of the sign words at ``word_at`` (one per column), row ``r``
    holding bit ``8 (r % 4) + r // 4`` (the planes' dp4a order: byte ``4j + i`` is column ``8i + j``)."""
    pos = tl.arange(0, 32)
    word = tl.load(signs_ptr + word_at, mask=mask_n, other=0)
    return ((word[None, :] >> (8 * (pos % 4) + pos // 4)[:, None]) & 1).to(tl.int8)


def quantize(x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0) -> QuantizedRows:
    """``x [M, K]`` (``K % 128 == 0``), first RMS-normalized with weight ``norm`` when given, quantized by
    ``act.rs``'s rule."""
    if x.dim() != 2 or x.shape[1] % QK or x.shape[1] == 0:
        raise ValueError(f"x must be [M, K] with K a positive multiple of {QK}, got {list(x.shape)}")
    if norm is not None and norm.shape != (x.shape[1],):
        raise ValueError(f"norm weight must be [{x.shape[1]}], got {list(norm.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    planes = torch.empty(2, padded_rows(m), k, dtype=torch.int8, device=x.device)
    planes[:, m:].zero_()
    scales = torch.empty(m, k // QK, dtype=torch.float32, device=x.device)
    sums = torch.empty(m, k // QK, dtype=torch.int32, device=x.device)
    if m:
        _quantize_kernel[(m,)](
            x, norm if norm is not None else x, planes, scales, sums,
            k, eps,
            x.stride(0), planes.stride(0), planes.stride(1), scales.stride(0),
            NORM=norm is not None, **NO_FUSION,
        )  # fmt: skip
    return QuantizedRows(planes, scales, sums)


def padded_rows(m: int) -> int:
    """Rows the planes hold for ``m`` activation rows: the GEMV's ``BLOCK_M`` (a power of 2) up to
    ``GEMV_MAX_M``, so its hot loop loads them unmasked."""
    return int(triton.next_power_of_2(m)) if 0 < m <= GEMV_MAX_M else m


def fused_linear(
    x: torch.Tensor,
    w: Q1Weight,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    asm: bool | None = None,
) -> torch.Tensor:
    """``ref_torch.q1_fused_linear`` in exact integer arithmetic: ``rms_norm(x, norm)`` quantized, times W,
    ``silu(gate) * up`` of a gate|up matrix (``gated``), ``+ residual``. ``asm`` (default: on CUDA,
    once ``asm_matches_twin`` holds there) picks the GEMV's PTX ``dp4a`` over its twin."""
    if x.dim() != 2 or x.shape[1] != w.cols:
        raise ValueError(f"x must be [M, {w.cols}], got {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    check_fused(x, w, norm, residual, gated)
    acts = quantize(x, norm, eps)
    return linear_quantized(acts, w, residual=residual, gated=gated, asm=asm)


def q1_linear(x: torch.Tensor, w: Q1Weight) -> torch.Tensor:
    """``x [M, K] @ W.T`` -> float32 ``[M, N]``, exactly as the CPU engine computes it."""
    return fused_linear(x, w)


def linear_quantized(
    acts: QuantizedRows,
    w: Q1Weight,
    *,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    asm: bool | None = None,
    kernel: str | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Quantized rows times W with the epilogue. ``kernel`` (one of ``KERNELS``; by default "gemv1" for
    one row of a matrix too small to fill the GPU, "gemv" up to ``GEMV_MAX_M`` rows, "gemm" above) and
    ``split_k`` (the GEMV's K splits over programs, or "gemv1"'s inside a program) exist for tests:
    every choice gives the same bits."""
    m = acts.rows
    out_rows = w.rows // 2 if gated else w.rows
    out = torch.empty(m, out_rows, dtype=torch.float32, device=acts.planes.device)
    if m == 0:
        return out
    if residual is not None:
        residual = residual.to(torch.float32)
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    kernel = kernel or _default_kernel(m, out_rows, w.cols // QK, out.device)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "gemm":
        _gemm(acts, w, residual, gated, out)
        return out
    asm = _asm_ok(acts.planes.device) if asm is None else asm
    if kernel == "gemv1":
        if m != 1:
            raise ValueError(f"the 'gemv1' kernel takes one activation row, got {m}")
        _gemv_one_row(acts, w, residual, gated, out, asm, split_k or _one_row_splits(w.cols // QK))
    else:
        _gemv(acts, w, residual, gated, out, asm, split_k)
    return out


def _gemv(
    acts: QuantizedRows,
    w: Q1Weight,
    residual: torch.Tensor | None,
    gated: bool,
    out: torch.Tensor,
    asm: bool,
    split_k: int | None = None,
) -> None:
    m, out_rows = out.shape
    block_m = triton.next_power_of_2(m)
    block_n = gemv_rows(block_m, gated)
    n_tiles, groups = triton.cdiv(out_rows, block_n), w.cols // QK
    split_k = min(split_k or _default_split_k(n_tiles, groups, out.device), groups)
    per_split = triton.cdiv(groups, split_k)
    split_k = triton.cdiv(groups, per_split)  # no empty splits
    ones = torch.empty(groups, m, w.rows, dtype=torch.int32, device=out.device) if split_k > 1 else out
    words = acts.planes.view(torch.int32)  # [2, M, K / 4]
    residual_or_out = residual if residual is not None else out
    _gemv_kernel[(n_tiles, split_k)](
        words, acts.scales, acts.sums, w.signs, w.scales, residual_or_out, out, ones,
        m, out_rows, w.cols, out_rows, per_split,
        words.stride(0), words.stride(1), acts.scales.stride(0), w.signs.stride(0), w.scales.stride(0),
        residual_or_out.stride(0), out.stride(0), ones.stride(0) if split_k > 1 else 0, ones.stride(-2),
        BLOCK_M=block_m, BLOCK_N=block_n, GATED=gated, RESIDUAL=residual is not None, SPLIT=split_k > 1,
        ASM=asm, **_gemv_options(block_m),
    )  # fmt: skip
    if split_k > 1:
        _combine_kernel[(n_tiles,)](
            ones, acts.scales, acts.sums, w.scales, residual_or_out, out,
            m, out_rows, w.cols, out_rows,
            acts.scales.stride(0), w.scales.stride(0), residual_or_out.stride(0), out.stride(0),
            ones.stride(0), ones.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, GATED=gated, RESIDUAL=residual is not None, **NO_FUSION,
        )  # fmt: skip


def _default_kernel(m: int, out_rows: int, groups: int, device: torch.device) -> str:
    if m > GEMV_MAX_M:
        return "gemm"
    split = m == 1 and _default_split_k(triton.cdiv(out_rows, gemv_rows(1, False)), groups, device) > 1
    return "gemv1" if split else "gemv"


def _one_row_splits(groups: int) -> int:
    """K splits inside a one-row GEMV program: up to 16, a power of 2, at most the groups."""
    return min(16, 1 << (groups.bit_length() - 1))


def _gemv_one_row(
    acts: QuantizedRows,
    w: Q1Weight,
    residual: torch.Tensor | None,
    gated: bool,
    out: torch.Tensor,
    asm: bool,
    splits: int,
) -> None:
    if splits & (splits - 1) or not 1 <= splits <= ONE_ROW_TILE // 16:
        raise ValueError(f"the one-row GEMV splits K in a power of 2 to {ONE_ROW_TILE // 16}, got {splits}")
    out_rows, groups = out.shape[1], w.cols // QK
    block_n = ONE_ROW_TILE // splits
    ones = torch.empty(groups, w.rows, dtype=torch.int32, device=out.device)
    words = acts.planes.view(torch.int32)
    residual_or_out = residual if residual is not None else out
    _gemv_one_row_kernel[(triton.cdiv(out_rows, block_n),)](
        words, acts.scales, acts.sums, w.signs, w.scales, residual_or_out, out, ones,
        out_rows, w.cols, out_rows, triton.cdiv(groups, splits),
        words.stride(0), w.signs.stride(0), w.scales.stride(0), ones.stride(0),
        BLOCK_N=block_n, SPLITS=splits, GATED=gated, RESIDUAL=residual is not None, ASM=asm,
        num_warps=ONE_ROW_TILE // 32, **NO_FUSION,
    )  # fmt: skip


def _gemv_options(block_m: int) -> dict[str, object]:
    """Launch options: no FP contraction; 8 warps for 8 activation rows (at 4, ptxas held the kernel
    to 128 registers and spilled, sm_90)."""
    return {**NO_FUSION, "num_warps": 8} if block_m >= 8 else NO_FUSION


def gemv_rows(block_m: int, gated: bool) -> int:
    """Weight rows per GEMV program at 4 warps: two rows per thread for one plain activation row (the
    activation loads are shared by a thread's rows; more rows per thread would leave too few warps
    for the LM head), one otherwise, never less, so activation rows stay in a thread (a thread that
    shared a weight row with others would repeat its unpacking)."""
    return 128 * max(1, 2 // (block_m * (2 if gated else 1)))


def _default_split_k(n_tiles: int, groups: int, device: torch.device) -> int:
    """Enough K splits for about ``PROGRAMS_PER_SM`` programs per SM on a GPU; none elsewhere."""
    if device.type != "cuda":
        return 1
    return max(1, min(groups, PROGRAMS_PER_SM * multiprocessors(device) // max(n_tiles, 1)))


def _gemm(
    acts: QuantizedRows, w: Q1Weight, residual: torch.Tensor | None, gated: bool, out: torch.Tensor
) -> None:
    m, out_rows = out.shape
    block_m = gemm_block_m(m)
    block_n = GEMM_BLOCK_N // (2 if gated else 1)  # gate|up: two accumulators of half the width
    residual_or_out = residual if residual is not None else out
    _gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(out_rows, block_n))](
        acts.planes, acts.scales, acts.sums, w.signs, w.scales, residual_or_out, out,
        m, out_rows, w.cols, out_rows,
        acts.planes.stride(0), acts.planes.stride(1), acts.scales.stride(0), w.signs.stride(0),
        w.scales.stride(0), residual_or_out.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, GATED=gated, RESIDUAL=residual is not None,
        num_warps=8 if block_m * GEMM_BLOCK_N >= 64 * 64 else 4, **NO_FUSION,
    )  # fmt: skip


def _asm_ok(device: torch.device) -> bool:
    return device.type == "cuda" and asm_matches_twin(device.index or 0)


@functools.cache
def asm_matches_twin(device_index: int) -> bool:
    """Whether the GEMVs' PTX ``dp4a`` gives their twins' bits on CUDA device ``device_index`` (random
    inputs; plain, gated and residual; 1, 3 and 8 rows; both GEMV kernels). On a mismatch or an error
    it warns, and the twins run: slower, the same bits as the CPU."""
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        w = Q1Weight(
            signs=torch.randint(-(2**31), 2**31, (96, 16), dtype=torch.int32, generator=gen).to(device),
            scales=(torch.rand(96, 4, generator=gen) + 0.5).to(torch.float16).to(device),
            rows=96,
            cols=512,
        )
        cases = ((1, False, "gemv"), (1, True, "gemv1"), (3, True, "gemv"), (8, False, "gemv"))
        for m, gated, kernel in cases:
            acts = quantize((torch.randn(m, 512, generator=gen) * 3).to(device))
            residual = torch.randn(m, 48 if gated else 96, generator=gen).to(device)
            args = {"residual": residual, "gated": gated, "kernel": kernel}
            ptx, twin = (linear_quantized(acts, w, asm=asm, **args) for asm in (True, False))
            if not torch.equal(ptx, twin):
                warnings.warn("the dp4a PTX GEMV differs from its twin here; the twin runs", stacklevel=3)
                return False
    except Exception as e:  # a PTX the driver rejects: never fatal, the twin is always there
        warnings.warn(f"the dp4a PTX GEMV failed here ({type(e).__name__}: {e}); the twin runs", stacklevel=3)
        return False
    return True

"""Triton Q1_0 linear layers, ``y = x @ W.T`` over a packed ``Q1Weight``: the twin of
``ref_torch.q1_linear``.

Two kernels in plain ``tl`` operations, so both also run under ``TRITON_INTERPRET=1``:

- a GEMV for ``M <= GEMV_MAX_M`` rows, with the RMSNorm before and the SwiGLU / residual add after a
  matmul folded in (``q1_gemv_fused``). Each weight costs three ALU operations per activation row:
  its sign bit is xor-ed into the bits of ``-x`` and the result added, all in float32, and threads
  reduce across each other once, at the end (the first version reduced every 128-group with
  shuffles: 24 SASS instructions per weight and row on sm_90 against about 4 now, counted by
  ``benches/gpu/sass.py``). Rows of W are split over programs, and optionally K (``split_k`` partial
  sums, reduced by the epilogue kernel);
- a GEMM for larger M. Each sign word of a 128-weight group decodes to a 32-row ±1 tile that goes
  through ``tl.dot``, the group's sum scaled by ``d`` (0.16 SASS instructions per multiply-add for the
  128x64 prefill tile on sm_90, against 0.33 for the first version's 64x64 per-element decode).
  ``precision`` picks the dot: "tf32" (default: float32 range, about 1e-3 relative on a GPU), "fp16"
  (activations rounded to fp16) or "ieee" (exact float32, slow on a GPU).

No CUDA-only unpack tricks (inline asm) belong here: a faster kernel goes into its own module and is
tested against this one."""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from oxibonsai.torch_backend.ops import ref_torch
from oxibonsai.torch_backend.ops.norm_triton import rms_norm
from oxibonsai.torch_backend.ops.q1_weight import QK, Q1Weight

GEMV_MAX_M = 8
GEMV_TILE = 128  # rows x activation rows per GEMV program (halved for gate|up): 4 sums per thread
PRECISIONS = ("tf32", "fp16", "ieee")


@triton.jit
def _gemv_kernel(
    x_ptr, signs_ptr, scales_ptr, norm_ptr, out_ptr, sumsq_ptr,
    M, N, K, groups_per_split, up_offset,
    stride_xm, stride_sn, stride_dn, stride_os, stride_om, stride_qs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """Partial ``out[split, m, n]`` over the 128-groups of split ``program_id(1)``, rows ``program_id(0)``.

    A program holds its rows' 4 sign words of a group for each activation row (the ``4 * BLOCK_M``
    cells of a 2-D tile: cell ``c`` is activation row ``c // 4``, word ``c % 4``) and walks the 32 bit
    positions: at position ``b`` it loads ``x`` at columns ``32 w + b`` and adds ``+x`` or ``-x`` by
    the bit, by xor-ing the bit (shifted to the sign position) into the bits of ``-x`` (shift,
    and+xor, add: 3 ALU operations per weight and row, no conversion, no reduction across threads
    until the end). Each group's sum is scaled by its ``d`` once. (A 3-D ``[BLOCK_N, BLOCK_M, 4]``
    tile made Triton move data through shared memory every bit for 2-4 rows.)

    ``NORM``: ``x`` times the RMSNorm weight goes in, and the split's sum of ``x^2`` per row goes to
    ``sumsq[split, m]`` (the norm's ``rstd`` factors out of the dot; the caller applies it).
    ``GATED``: the program also computes rows ``n + up_offset`` (the up half of a gate|up matrix)
    into ``out[split, m, up_offset + n]``, with the same loads of ``x``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cells = tl.arange(0, BLOCK_M * 4)
    row_of, word_of = cells // 4, cells % 4
    mask_n = offs_n < N
    mask_c = row_of < M
    split = tl.program_id(1)
    first = split * groups_per_split
    last = tl.minimum(first + groups_per_split, K // 128)
    acc = tl.zeros([BLOCK_N, BLOCK_M * 4], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M * 4], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M * 4], dtype=tl.float32)
    for g in range(first, last):
        word_ptrs = signs_ptr + offs_n[:, None] * stride_sn + g * 4 + word_of[None, :]
        words = tl.load(word_ptrs, mask=mask_n[:, None], other=0)
        words_up = words
        if GATED:
            words_up = tl.load(word_ptrs + up_offset * stride_sn, mask=mask_n[:, None], other=0)
        part = tl.zeros([BLOCK_N, BLOCK_M * 4], dtype=tl.float32)
        part_up = tl.zeros([BLOCK_N, BLOCK_M * 4], dtype=tl.float32)
        for b in tl.static_range(32):
            cols = g * 128 + word_of * 32 + b
            x = tl.load(x_ptr + row_of * stride_xm + cols, mask=mask_c, other=0.0).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * tl.load(norm_ptr + cols).to(tl.float32)
            neg = (-x).to(tl.int32, bitcast=True)
            part += _signed(neg, words, b)
            if GATED:
                part_up += _signed(neg, words_up, b)
        acc += _scale(part, scales_ptr, offs_n, mask_n, g, stride_dn)
        if GATED:
            acc_up += _scale(part_up, scales_ptr, offs_n + up_offset, mask_n, g, stride_dn)
    offs_m = tl.arange(0, BLOCK_M)
    mask = mask_n[:, None] & (offs_m < M)[None, :]
    out = out_ptr + split * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, tl.sum(tl.reshape(acc, [BLOCK_N, BLOCK_M, 4]), axis=2), mask=mask)
    if GATED:
        tl.store(out + up_offset, tl.sum(tl.reshape(acc_up, [BLOCK_N, BLOCK_M, 4]), axis=2), mask=mask)
    if NORM:
        if tl.program_id(0) == 0:  # every row tile computed the same sums
            sums = tl.sum(tl.reshape(squares, [BLOCK_M, 4]), axis=1)
            tl.store(sumsq_ptr + split * stride_qs + offs_m, sums, mask=offs_m < M)


@triton.jit
def _signed(neg, words, b: tl.constexpr):
    """``[BLOCK_N, 4 * BLOCK_M]``: ``x`` where bit ``b`` of the cell's word is set, else ``-x``, from the
    bits of ``-x`` (``neg``, one per cell)."""
    sign = (words << (31 - b)) & -2147483648  # bit b at the float sign position
    return (neg[None, :] ^ sign).to(tl.float32, bitcast=True)


@triton.jit
def _scale(part, scales_ptr, offs_n, mask_n, g, stride_dn):
    """A group's sums ``part`` times each row's scale ``d``."""
    d = tl.load(scales_ptr + offs_n * stride_dn + g, mask=mask_n, other=0.0).to(tl.float32)
    return d[:, None] * part


@triton.jit
def _epilogue_kernel(
    partial_ptr, sumsq_ptr, residual_ptr, out_ptr,
    N, K, splits, eps, up_offset,
    stride_ps, stride_pm, stride_qs, stride_rm, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
):  # fmt: skip
    """``out[m, n]`` from the GEMV's split partials of row ``program_id(0)``: their sum, times the
    RMSNorm ``rstd`` (``NORM``), as ``silu(gate) * up`` (``GATED``), plus ``residual`` (``RESIDUAL``)."""
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_s = tl.arange(0, BLOCK_S)
    mask = (offs_s[:, None] < splits) & mask_n[None, :]
    rows = partial_ptr + offs_s[:, None] * stride_ps + m * stride_pm + offs_n[None, :]
    y = tl.sum(tl.load(rows, mask=mask, other=0.0), axis=0)
    if NORM:
        sumsq = tl.sum(tl.load(sumsq_ptr + offs_s * stride_qs + m, mask=offs_s < splits, other=0.0), axis=0)
        rstd = 1.0 / tl.sqrt(sumsq / K + eps)
        y = y * rstd
    if GATED:
        up = tl.sum(tl.load(rows + up_offset, mask=mask, other=0.0), axis=0)
        if NORM:
            up = up * rstd
        y = y * tl.sigmoid(y) * up
    if RESIDUAL:
        y += tl.load(residual_ptr + m * stride_rm + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, y, mask=mask_n)


@triton.jit
def _gemm_kernel(
    x_ptr, signs_ptr, scales_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_sn, stride_dn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP16: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``out[m, n]`` for one ``BLOCK_M x BLOCK_N`` tile: per 128-group, four ``tl.dot``s of 32 columns,
    each against the ±1 tile of one sign word per row (loaded once, its 32 bits spread by a shift),
    the group's sum scaled by ``d`` after."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    bits = tl.arange(0, 32)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, K // 128):
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for w in tl.static_range(4):
            cols = g * 128 + w * 32 + bits
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask_m[:, None], other=0.0)
            word = tl.load(signs_ptr + offs_n * stride_sn + g * 4 + w, mask=mask_n, other=0)  # [BLOCK_N]
            signs = tl.where(((word[None, :] >> bits[:, None]) & 1) != 0, 1.0, -1.0)  # [32, BLOCK_N]
            if DOT_FP16:
                part = tl.dot(x.to(tl.float16), signs.to(tl.float16), part)
            else:
                part = tl.dot(x.to(tl.float32), signs, part, input_precision=PRECISION)
        d = tl.load(scales_ptr + offs_n * stride_dn + g, mask=mask_n, other=0.0).to(tl.float32)
        acc += part * d[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


def q1_linear(x: torch.Tensor, w: Q1Weight) -> torch.Tensor:
    """``x [M, K] @ W.T`` -> float32 ``[M, N]``: the GEMV for ``M <= GEMV_MAX_M``, else the GEMM."""
    if x.shape[0] <= GEMV_MAX_M:
        return q1_gemv(x, w)
    return q1_gemm(x, w)


def q1_fused_linear(
    x: torch.Tensor,
    w: Q1Weight,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """``ref_torch.q1_fused_linear``'s twin: the fused GEMV for ``M <= GEMV_MAX_M``; above, the norm,
    the GEMM and the epilogue as separate launches (prefill is not launch-bound)."""
    if x.shape[0] <= GEMV_MAX_M:
        return q1_gemv_fused(x, w, norm=norm, eps=eps, residual=residual, gated=gated)
    normed = x if norm is None else rms_norm(x, norm, eps)
    return ref_torch.fused_linear(q1_gemm, normed, w, residual=residual, gated=gated)


def q1_gemv(
    x: torch.Tensor, w: Q1Weight, block_n: int | None = None, split_k: int | None = None
) -> torch.Tensor:
    """The sign-flip GEMV (any M, meant for ``M <= GEMV_MAX_M``); ``split_k`` partial sums over K."""
    return q1_gemv_fused(x, w, block_n=block_n, split_k=split_k)


def q1_gemv_fused(
    x: torch.Tensor,
    w: Q1Weight,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    block_n: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """The GEMV with what surrounds a matmul in the model folded in: ``rms_norm(x, norm, eps)`` as its
    input (``norm``), ``silu(gate) * up`` of a gate|up matrix as its output (``gated``: W's first half
    of rows is the gate, the second the up; the output has half W's rows), and ``residual +`` the
    result (``residual``). One launch, plus one for the epilogue when K is split or an epilogue is
    asked for."""
    fused = {"norm": norm, "eps": eps, "residual": residual, "gated": gated}
    return launch_gemv(_gemv_kernel, x, w, GEMV_TILE, block_n=block_n, split_k=split_k, **fused)


def launch_gemv(
    kernel: Any,
    x: torch.Tensor,
    w: Q1Weight,
    tile: int,
    *,
    norm: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    gated: bool,
    block_n: int | None = None,
    split_k: int | None = None,
    **constexprs: Any,
) -> torch.Tensor:
    """Checks the operands, sizes the grid (``tile`` rows x activation rows per program, halved for
    gate|up; K split for about two programs per SM), runs a GEMV kernel with ``_gemv_kernel``'s
    arguments (and ``constexprs``), then the epilogue where one is needed."""
    x = _check(x, w)
    out_rows = w.rows // 2 if gated else w.rows
    check_fused(x, w, norm, residual, gated)
    m, groups = x.shape[0], w.cols // QK
    if m == 0:
        return torch.empty(0, out_rows, dtype=torch.float32, device=x.device)
    block_m = triton.next_power_of_2(m)
    block_n = block_n or max(8, tile // block_m // (2 if gated else 1))
    n_tiles = triton.cdiv(out_rows, block_n)
    split_k = min(split_k or _default_split_k(n_tiles, groups, x.device), groups)
    groups_per_split = triton.cdiv(groups, split_k)
    split_k = triton.cdiv(groups, groups_per_split)  # no empty splits
    partial = torch.empty(split_k, m, w.rows, dtype=torch.float32, device=x.device)
    sumsq = torch.empty(split_k, m, dtype=torch.float32, device=x.device) if norm is not None else partial
    kernel[(n_tiles, split_k)](
        x, w.signs, w.scales, norm if norm is not None else x, partial, sumsq,
        m, out_rows, w.cols, groups_per_split, out_rows,
        x.stride(0), w.signs.stride(0), w.scales.stride(0), partial.stride(0), partial.stride(1),
        sumsq.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, NORM=norm is not None, GATED=gated, **constexprs,
    )  # fmt: skip
    if split_k == 1 and norm is None and residual is None and not gated:
        return partial[0]
    return _epilogue(partial, sumsq, norm is not None, eps, residual, gated, out_rows, w.cols)


def check_fused(
    x: torch.Tensor, w: Q1Weight, norm: torch.Tensor | None, residual: torch.Tensor | None, gated: bool
) -> None:
    """Raises ValueError unless the fused GEMV's operands fit ``w`` (``x`` already checked)."""
    out_rows = w.rows // 2 if gated else w.rows
    if gated and w.rows % 2:
        raise ValueError(f"a gate|up matrix needs an even number of rows, got {w.rows}")
    if norm is not None and norm.shape != (w.cols,):
        raise ValueError(f"norm weight must be [{w.cols}], got {list(norm.shape)}")
    if residual is not None and residual.shape != (x.shape[0], out_rows):
        raise ValueError(f"residual must be [{x.shape[0]}, {out_rows}], got {list(residual.shape)}")


def _epilogue(
    partial: torch.Tensor,
    sumsq: torch.Tensor,
    normed: bool,
    eps: float,
    residual: torch.Tensor | None,
    gated: bool,
    out_rows: int,
    cols: int,
) -> torch.Tensor:
    splits, m = partial.shape[0], partial.shape[1]
    out = torch.empty(m, out_rows, dtype=torch.float32, device=partial.device)
    block_n = 256
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    _epilogue_kernel[(m, triton.cdiv(out_rows, block_n))](
        partial, sumsq, residual if residual is not None else out, out,
        out_rows, cols, splits, eps, out_rows,
        partial.stride(0), partial.stride(1), sumsq.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        BLOCK_N=block_n, BLOCK_S=triton.next_power_of_2(splits), NORM=normed,
        RESIDUAL=residual is not None, GATED=gated,
    )  # fmt: skip
    return out


def q1_gemm(
    x: torch.Tensor, w: Q1Weight, block_m: int | None = None, block_n: int = 64, precision: str = "tf32"
) -> torch.Tensor:
    """The ``tl.dot`` GEMM; ``precision`` is one of ``PRECISIONS`` (see the module doc)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    x = _check(x, w)
    m = x.shape[0]
    if m == 0:
        return torch.empty(0, w.rows, dtype=torch.float32, device=x.device)
    block_m = block_m or gemm_block_m(m)
    out = torch.empty(m, w.rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(w.rows, block_n))
    _gemm_kernel[grid](
        x, w.signs, w.scales, out,
        m, w.rows, w.cols,
        x.stride(0), w.signs.stride(0), w.scales.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP16=precision == "fp16",
        PRECISION="ieee" if precision == "fp16" else precision,
        num_warps=8 if block_m * block_n >= 64 * 64 else 4,  # sm_90: a 64x64 tile spills at 4 warps
    )  # fmt: skip
    return out


def gemm_block_m(m: int) -> int:
    """The GEMM's tile height for ``m`` rows. It changes only at multiples of 8 (16, 32, 64, past 128),
    so a decode step padded to its CUDA-graph bucket (``graphs.decode_buckets``) runs the tiles its
    eager twin runs."""
    return 128 if m > 128 else min(64, max(16, int(triton.next_power_of_2(m))))


def _check(x: torch.Tensor, w: Q1Weight) -> torch.Tensor:
    """``x`` as a 2-D tensor with unit column stride, after checking it against ``w``."""
    if x.dim() != 2 or x.shape[1] != w.cols:
        raise ValueError(f"x must be [M, {w.cols}], got {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


def _default_split_k(n_tiles: int, groups: int, device: torch.device) -> int:
    """Enough K splits for about two programs per SM on a GPU; none elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return max(1, min(groups, 2 * multiprocessors(device) // max(n_tiles, 1)))


def multiprocessors(device: torch.device) -> int:
    """The SM count of CUDA ``device`` (the current one where it has no index)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    """The SM count of CUDA device ``index``, asked once (the query costs microseconds per call)."""
    return int(torch.cuda.get_device_properties(index).multi_processor_count)

"""The fast Q1_0 GEMV for CUDA: two weights per instruction in packed fp16 (``f16x2``), through inline
PTX, with a plain-Triton twin of each PTX snippet that is bit-exact and runs in the interpreter.

``q1_triton``'s GEMV spends three operations per weight (shift, and+xor, float add). Here a sign word's
bits ``b`` and ``b + 16`` are shifted to positions 15 and 31 at once, so one ``lop3`` flips the signs of
a packed pair of fp16 activations and one ``add.rn.f16x2`` adds the pair: 1.5 operations per weight
and row. Each group of 128 activations is scaled by its largest magnitude first (so every value is in
[-1, 1] and no fp16 sum of a word's 16 pairs can overflow, whatever the activations' range), the
group's pair sums are widened to float32 and times ``d`` and the group scale. The cost is fp16
rounding of the scaled activations and of 16-term sums: up to 1.8e-3 of the largest output against
float64 over 30 random cases (``tests/torch_backend/test_q1_fast.py`` bounds it), the precision class
of llama.cpp's int8 activations.

``ASM`` (a constexpr) picks the PTX or its twin. ``fused_linear`` (the CUDA op set's
``q1_fused_linear``) runs this kernel for up to ``MAX_M`` rows on CUDA once ``asm_matches_twin`` has
found the PTX and its twin equal bit for bit on that device (checked once per process and device;
on a mismatch or an error it warns and ``q1_triton``'s GEMV runs instead), and ``q1_triton``'s
fused linear otherwise. The RMSNorm prologue and the epilogues (the
split-K sum, ``rstd``, SwiGLU, residual) are ``q1_triton``'s."""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from oxibonsai.torch_backend.ops import q1_triton
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight

SIGNS_15_31 = tl.constexpr(-2147450880)  # 0x80008000 as an int32: both halves' sign bits
TILE = 256  # rows x activation rows per program, halved for gate|up: 2.45 SASS ops per weight at M=1
MAX_M = 2  # above, the packing of activations costs more than it saves (benches/gpu/sass.py)


@triton.jit
def _pack_f16x2(lo, hi, ASM: tl.constexpr):
    """int32: fp16(``hi``) in the upper half, fp16(``lo``) in the lower, each rounded to nearest."""
    if ASM:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        return (hi16 << 16) | lo16


@triton.jit
def _half(word, upper: tl.constexpr):
    """One half of an int32 as fp16."""
    bits = (word >> 16) if upper else word
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _add_signed_pair(acc, x2, shifted, ASM: tl.constexpr):
    """``acc + ±x2`` in f16x2: each half of ``x2`` keeps its sign where the matching bit of ``shifted``
    (bit 15 for the lower half, 31 for the upper) is set and is negated where it is clear."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, m; mov.b32 m, 0x80008000; lop3.b32 t, $2, m, $1, 0xA6; add.rn.f16x2 $0, $3, t; }",
            "=r,r,r,r", [x2, shifted, acc], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        signed = (~shifted & SIGNS_15_31) ^ x2  # lop3's 0xA6: (~a & b) ^ c
        lo = (_half(signed, False) + _half(acc, False)).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = (_half(signed, True) + _half(acc, True)).to(tl.int16, bitcast=True).to(tl.int32)
        return (hi << 16) | lo


@triton.jit
def _pair_sums(acc2):
    """The two fp16 halves of each packed sum, widened to float32 and added."""
    return _half(acc2, False).to(tl.float32) + _half(acc2, True).to(tl.float32)


@triton.jit
def _fast_gemv_kernel(
    x_ptr, signs_ptr, scales_ptr, norm_ptr, out_ptr, sumsq_ptr,
    M, N, K, groups_per_split, up_offset,
    stride_xm, stride_sn, stride_dn, stride_os, stride_om, stride_qs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """``q1_triton._gemv_kernel``'s contract (partials per split, ``sumsq`` with ``NORM``, the up rows
    with ``GATED``), in packed fp16 pairs (see the module doc)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    quarter = tl.arange(0, 4)
    lanes = tl.arange(0, 128)
    mask_n = offs_n < N
    mask_m = offs_m < M
    split = tl.program_id(1)
    first = split * groups_per_split
    last = tl.minimum(first + groups_per_split, K // 128)
    acc = tl.zeros([BLOCK_N, BLOCK_M, 4], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M, 4], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    for g in range(first, last):
        group = tl.load(x_rows + g * 128 + lanes[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
        if NORM:
            squares += group * group
            group = group * tl.load(norm_ptr + g * 128 + lanes).to(tl.float32)[None, :]
        amax = tl.max(tl.abs(group), axis=1)  # [BLOCK_M]
        inv = tl.where(amax > 0, 1.0 / tl.maximum(amax, 1e-30), 0.0)
        word_ptrs = signs_ptr + offs_n[:, None] * stride_sn + g * 4 + quarter[None, :]
        words = tl.load(word_ptrs, mask=mask_n[:, None], other=0)
        words_up = words
        if GATED:
            words_up = tl.load(word_ptrs + up_offset * stride_sn, mask=mask_n[:, None], other=0)
        sums = tl.zeros([BLOCK_N, BLOCK_M, 4], dtype=tl.int32)
        sums_up = tl.zeros([BLOCK_N, BLOCK_M, 4], dtype=tl.int32)
        for b in tl.static_range(16):
            cols = g * 128 + quarter * 32 + b
            lo = tl.load(x_rows + cols[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
            hi = tl.load(x_rows + cols[None, :] + 16, mask=mask_m[:, None], other=0.0).to(tl.float32)
            if NORM:
                lo = lo * tl.load(norm_ptr + cols).to(tl.float32)[None, :]
                hi = hi * tl.load(norm_ptr + cols + 16).to(tl.float32)[None, :]
            x2 = _pack_f16x2(lo * inv[:, None], hi * inv[:, None], ASM)[None, :, :]  # [1, BLOCK_M, 4]
            sums = _add_signed_pair(sums, x2, (words << (15 - b))[:, None, :], ASM)
            if GATED:
                sums_up = _add_signed_pair(sums_up, x2, (words_up << (15 - b))[:, None, :], ASM)
        acc += _scaled(_pair_sums(sums), amax, scales_ptr, offs_n, mask_n, g, stride_dn)
        if GATED:
            acc_up += _scaled(_pair_sums(sums_up), amax, scales_ptr, offs_n + up_offset, mask_n, g, stride_dn)
    out = out_ptr + split * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, tl.sum(acc, axis=2), mask=mask_n[:, None] & mask_m[None, :])
    if GATED:
        tl.store(out + up_offset, tl.sum(acc_up, axis=2), mask=mask_n[:, None] & mask_m[None, :])
    if NORM:
        if tl.program_id(0) == 0:
            tl.store(sumsq_ptr + split * stride_qs + offs_m, tl.sum(squares, axis=1), mask=mask_m)


@triton.jit
def _scaled(part, amax, scales_ptr, offs_n, mask_n, g, stride_dn):
    """A group's sums times each row's ``d`` and each activation row's group scale."""
    d = tl.load(scales_ptr + offs_n * stride_dn + g, mask=mask_n, other=0.0).to(tl.float32)
    return d[:, None, None] * amax[None, :, None] * part


def q1_gemv_fast(
    x: torch.Tensor,
    w: Q1Weight,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    asm: bool | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``q1_triton.q1_gemv_fused`` in packed fp16 pairs; ``asm`` (default: on CUDA) picks the PTX or its
    twin."""
    asm = x.is_cuda if asm is None else asm
    fused = {"norm": norm, "eps": eps, "residual": residual, "gated": gated}
    # two rows at 4 warps spilled with the norm (sm_90, Triton's divisibility hints); 2 warps do not
    warps = {"num_warps": 2} if x.dim() == 2 and x.shape[0] == 2 else {}
    return q1_triton.launch_gemv(_fast_gemv_kernel, x, w, TILE, split_k=split_k, ASM=asm, **fused, **warps)


def fused_linear(
    x: torch.Tensor,
    w: Q1Weight,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """``q1_triton.q1_fused_linear``, with this module's GEMV where it is checked and pays (see the
    module doc)."""
    if x.shape[0] <= MAX_M and x.shape[0] > 0 and _asm_ok(x.device):
        return q1_gemv_fast(x, w, norm=norm, eps=eps, residual=residual, gated=gated, asm=True)
    return q1_triton.q1_fused_linear(x, w, norm=norm, eps=eps, residual=residual, gated=gated)


def _asm_ok(device: torch.device) -> bool:
    return device.type == "cuda" and asm_matches_twin(device.index or 0)


@functools.cache
def asm_matches_twin(device_index: int) -> bool:
    """Whether the PTX kernel gives the twin's bits on CUDA device ``device_index``, on random inputs
    through every variant the model uses (plain, normed and gated, one and two rows, split K)."""
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        w = Q1Weight(
            signs=torch.randint(-(2**31), 2**31, (96, 16), dtype=torch.int32, generator=gen).to(device),
            scales=(torch.rand(96, 4, generator=gen) + 0.5).to(torch.float16).to(device),
            rows=96,
            cols=512,
        )
        for m, gated, split_k in ((1, False, 1), (2, True, 2), (1, True, 4)):
            x = (torch.randn(m, 512, generator=gen) * 3).to(device)
            norm = (torch.rand(512, generator=gen) + 0.5).to(device)
            args = {"norm": norm, "eps": 1e-6, "gated": gated, "split_k": split_k}
            if not torch.equal(q1_gemv_fast(x, w, asm=True, **args), q1_gemv_fast(x, w, asm=False, **args)):
                warnings.warn(
                    "the f16x2 PTX GEMV differs from its twin here; the plain GEMV runs", stacklevel=3
                )
                return False
    except Exception as e:  # a PTX the driver rejects: never fatal, the plain GEMV is always there
        warnings.warn(
            f"the f16x2 PTX GEMV failed here ({type(e).__name__}: {e}); the plain GEMV runs", stacklevel=3
        )
        return False
    return True

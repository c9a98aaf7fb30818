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

- ``quantize``: ``QUANTIZE_BLOCKS`` blocks of one activation row per program, a warp per block, so a
  row's blocks are quantized side by side (at one row a single program looping over them would be a
  chain of some 150 instructions and 8 barriers per block: 48 times over for the down projection's
  input), the RMSNorm before the matmul folded in (each program of a row computes the row's mean
  square itself, in the same order).
- the GEMV (``M <= GEMV_MAX_M``): one weight row per thread lane and every activation row in the same
  thread, no reduction across threads: per sign word, 8 shift-and-mask operations expose 4 weights
  each, and per activation row two ``dp4a`` (high and low plane) add them; about 1.3 SASS instructions
  per weight at one row (``benches/gpu/sass.py``), where a thread loads a group's sign words in one
  16-byte load and its activations two pairs a load, the words of the group after next during this
  one's work (ptxas issues them at the end of the work, so they have a whole group's work to come:
  session 25's LM head GEMV, loading only the next group's there, streamed at 17% of the H200's copy).
  ``ASM`` picks the inline-PTX ``dp4a`` or its plain-Triton twin, which gives the same integers and
  runs in the interpreter. A matrix with too few
  rows to fill the GPU splits K: at one row inside each program ("gemv_split", ``_gemv_split_kernel``:
  each lane takes one (split, weight row) pair for every activation row, stores each group's integer
  sums, a barrier, then the program adds the groups in order), at 2-8 rows over programs with a
  second kernel adding the groups (``_combine_kernel``): on the H200 (session 25, 1.7B's 2048 x 2048
  Q) that took 8.8 us at 4 rows against 19-21 us for the in-program split, and 5.3 against 6.0 us at
  one row. The SwiGLU of a gate|up matrix and the residual add run in the program that adds the
  groups. "gemv_fixup" splits over programs in one launch: each program counts its tile's finished
  splits (``tile_counts``) and the last to finish adds the tile's groups in order, as the combine
  launch would (the stream-K "fix-up"); the same bits. Session 25's profile had the one-row
  "gemv_split" at 120-137 GB/s in the model where the unsplit "gemv" of the LM head reached 700, so
  ``OXIBONSAI_ONE_ROW_GEMV`` picks among the three forms at one row (``one_row_gemv``) for the GPU
  bench to time. It takes up to ``FIXUP_MAX_M`` rows (at 8 its combine spilled, sm_90).
- quantized ahead (``linear_then_quantize``, ``ops.ahead``): a "gemv_split" launch, a split "gemv"'s
  combine launch or a "gemv_fixup"'s combining programs (up to ``FUSED_COMBINE_MAX_M`` rows), also
  quantizes its output for the next matmul,
  RMSNorm included, so such a decode step runs no quantization launch after its first matmul. Each program,
  once its columns are stored, fences and adds one to an arrival count of its unit of columns
  (``QUANTIZE_UNIT``, or the whole row with a norm, whose mean square needs every column); the
  program that completes a unit resets the count and quantizes the unit from L2, exactly as
  ``quantize`` would. Other kernels quantize in a launch of their own.
- the GEMM (larger M, prefill): each sign word's bits become a 32 x BLOCK_N tile of 0/1 bytes (or a
  whole group's a 128 x BLOCK_N tile, ``group_dot``) and both planes go through int8 ``tl.dot``
  (integer tensor cores on a GPU, exact), gate and up rows of a gate|up matrix in the same program,
  the epilogue in the same code as the GEMV's (``_finish``). A program adds its groups one after
  another, so where a matrix has too few tiles to fill the GPU the tiles narrow (``gemm_block_n``)
  and then K splits over programs (``gemm_split_k``: each split stores its groups' integer sums, and
  the GEMV's ``_combine_kernel`` adds them in order). On the H200 (session 25), unsplit, it was
  latency-bound: 25 us a launch at 16 rows for 1.7B's matrices, whose weights stream in about 1 us;
  by the SASS a 16 x 32 program is 4 warps of some 330 instructions a group, one warp per scheduler,
  so nothing hides a stall.

Kernels launch with floating-point contraction off (``enable_fp_fusion=False``): every rounding is the
one written, and the CPU's fused multiply-add is an explicit ``tl.fma``."""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch
import triton

from oxibonsai.torch_backend.ops import pdl, q1_tuned
from oxibonsai.torch_backend.ops.ahead import QuantizeNext
from oxibonsai.torch_backend.ops.q1_exact_kernels import (
    _combine_kernel,
    _expand_kernel,
    _gemm_kernel,
    _gemv_kernel,
    _gemv_split_kernel,
    _quantize_kernel,
)
from oxibonsai.torch_backend.ops.q1_triton import check_fused, gemm_block_m, multiprocessors
from oxibonsai.torch_backend.ops.q1_weight import QK, Q1Weight

GEMV_MAX_M = 8
KERNELS = ("gemv", "gemv_fixup", "gemv_split", "gemm", "gemm_expanded")
GEMM_BLOCK_N = 64  # weight rows of a GEMM tile (32 and 32 for gate|up), at most
GEMM_MIN_BLOCK_N = 16  # the narrowest GEMM tile (int8 tl.dot needs 16)
GEMM_GROUP_DOT = False  # whether the GEMM's dots take a whole 128-weight group, not one sign word
EXPAND_ROWS = 64  # weight rows per program of "gemm_expanded"'s bit expansion
GEMM_PROGRAMS_PER_SM = 2  # the GEMM splits K over programs until it has this many per SM
GEMM_MIN_SPLIT_GROUPS = 4  # groups of a GEMM split, at least
GEMM_MAX_SCRATCH = 32 << 20  # bytes of a split GEMM's integer sums, at most (H100 L2: 50 MB)
COMBINE_BLOCK_M, COMBINE_BLOCK_N = 16, 32  # a split GEMM's combine tile
COMBINE_ELEMENTS = 512  # a GEMV combine program's outputs, gate and up counted ([8, 128] gated spilled)
FIXUP_COLUMNS = 128  # output columns a "gemv_fixup" tile's combining program adds at once, at most
FIXUP_MAX_M = 4  # activation rows "gemv_fixup" takes (at 8 the gated combine spilled, sm_90)
FIXUP_QUANTIZE_MAX_M = 2  # rows it quantizes for the next matmul itself (at 4 the normed one spilled)
SPLIT_TILE = 256  # splits x weight rows of a "gemv_split" program: one pair per thread, 8 warps
GROUP_CHUNK = 6  # a "gemv_split" split's groups in one stretch of straight code, at most (below 8 rows)
PROGRAMS_PER_SM = 4  # the GEMV splits K until it has this many 4-warp programs per SM
QUANTIZE_BLOCKS = 4  # 128-value blocks per quantization program, a warp each
NORM_CHUNK = 2048  # values of a row a quantization program squares at once for its RMSNorm
NO_FUSION = {"enable_fp_fusion": False}
FUSED_COMBINE_MAX_M = 4  # rows a split GEMV's combine quantizes for the next matmul, at most (8 spilled)
QUANTIZE_UNIT = 1024  # output columns a "gemv_split" launch quantizes per unit for the next matmul (no norm)
ARRIVAL_COUNTS = 64  # units a launch may count its programs in
TILE_COUNTS = 4096  # tiles a "gemv_fixup" launch may count its splits in
FUSE_ENV_VAR = "OXIBONSAI_FUSE_QUANTIZE"
ONE_ROW_ENV_VAR = "OXIBONSAI_ONE_ROW_GEMV"
ONE_ROW_KERNELS = ("gemv_split", "gemv", "gemv_fixup")


@dataclass(frozen=True)
class QuantizedRows:
    """``M`` activation rows quantized per 128 values (``act.rs``'s rule)."""

    planes: torch.Tensor  # int8 [2, padded_rows(M), K]: high then low bytes of q, 32 columns in dp4a order
    scales: torch.Tensor  # float32 [M, K / 128]; NaN for a block with a non-finite value
    sums: torch.Tensor  # int32 [M, K / 128]: each block's sum of q

    @classmethod
    def empty(cls, m: int, k: int, device: torch.device) -> QuantizedRows:
        """Room for ``m`` rows of ``k`` values (a kernel fills rows ``0..m``); the planes' padding rows
        (3, 5-7 rows: ``padded_rows``) are zeros, which the GEMV reads."""
        planes = torch.empty(2, padded_rows(m), k, dtype=torch.int8, device=device)
        if planes.shape[1] > m:  # nothing to launch otherwise
            planes[:, m:].zero_()
        scales = torch.empty(m, k // QK, dtype=torch.float32, device=device)
        return cls(planes, scales, torch.empty(m, k // QK, dtype=torch.int32, device=device))

    @property
    def rows(self) -> int:
        return int(self.scales.shape[0])

    def values(self) -> torch.Tensor:
        """int32 ``[M, K]`` of q in column order (tests and oracles only)."""
        m, k = self.rows, self.planes.shape[2]
        q = self.planes[0, :m].to(torch.int32) * 256 + self.planes[1, :m].to(torch.int32)
        return q.reshape(m, k // 32, 8, 4).transpose(2, 3).reshape(m, k)


def quantize(x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0) -> QuantizedRows:
    """``x [M, K]`` (``K % 128 == 0``), first RMS-normalized with weight ``norm`` when given, quantized by
    ``act.rs``'s rule."""
    if x.dim() != 2 or x.shape[1] % QK or x.shape[1] == 0:
        raise ValueError(f"x must be [M, K] with K a positive multiple of {QK}, got {list(x.shape)}")
    if norm is not None and norm.shape != (x.shape[1],):
        raise ValueError(f"norm weight must be [{x.shape[1]}], got {list(norm.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    acts = QuantizedRows.empty(m, k, x.device)
    if m:
        _quantize_kernel[(m, triton.cdiv(k // QK, QUANTIZE_BLOCKS))](
            x, norm if norm is not None else x, acts.planes, acts.scales, acts.sums,
            k, eps,
            x.stride(0), acts.planes.stride(0), acts.planes.stride(1), acts.scales.stride(0),
            BLOCKS=QUANTIZE_BLOCKS, NORM_CHUNK=min(triton.next_power_of_2(k), NORM_CHUNK),
            NORM=norm is not None, num_warps=QUANTIZE_BLOCKS, **pdl.launch(x.device), **NO_FUSION,
        )  # fmt: skip
    return acts


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
    out, _ = fused_linear_ahead(x, w, norm=norm, eps=eps, residual=residual, gated=gated, asm=asm)
    return out


def fused_linear_ahead(
    x: torch.Tensor,
    w: Q1Weight,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    acts: QuantizedRows | None = None,
    then: QuantizeNext | None = None,
    asm: bool | None = None,
) -> tuple[torch.Tensor, QuantizedRows | None]:
    """``fused_linear`` with its activations quantized ahead (``ops.ahead``): ``acts``, when given, is
    ``quantize(x, norm, eps)`` already; with ``then`` the output's quantization for the next matmul
    comes back beside it (``linear_then_quantize``), None without."""
    if x.dim() != 2 or x.shape[1] != w.cols:
        raise ValueError(f"x must be [M, {w.cols}], got {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    check_fused(x, w, norm, residual, gated)
    if acts is None:
        acts = quantize(x, norm, eps)
    elif acts.rows != x.shape[0] or acts.planes.shape[2] != w.cols:
        raise ValueError(f"acts hold {acts.rows} rows of {acts.planes.shape[2]}, not x's {list(x.shape)}")
    if then is None:
        return linear_quantized(acts, w, residual=residual, gated=gated, asm=asm), None
    return linear_then_quantize(acts, w, then, residual=residual, gated=gated, asm=asm)


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
    block_n: int | None = None,
    group_dot: bool | None = None,
) -> torch.Tensor:
    """Quantized rows times W with the epilogue. ``kernel`` (one of ``KERNELS``; by default, up to
    ``GEMV_MAX_M`` rows "gemv", or at one row "gemv_split" for a matrix too small to fill the GPU;
    "gemm" above; "gemv_fixup" is the GEMV split over programs combined in its own launch, up to
    ``FIXUP_MAX_M`` rows; "gemm_expanded" the GEMM on weights expanded to bytes first, ``expand_bits``),
    ``split_k`` (the GEMV's or the GEMM's K splits over programs, or "gemv_split"'s inside a program),
    ``block_n`` (the GEMM tile's weight rows, per half of a gate|up matrix, default ``gemm_block_n``;
    or the "gemv" program's, ``gemv_block_ns``) and ``group_dot`` (the GEMM's dot depth: a whole
    group, or one sign word) exist for tests and tuning: every choice gives the same bits. With none
    given, a form the GPU's table measured faster (``q1_tuned``) replaces the defaults."""
    out, _ = _linear(acts, w, residual, gated, asm, kernel, split_k, block_n, group_dot, None)
    return out


def linear_then_quantize(
    acts: QuantizedRows,
    w: Q1Weight,
    then: QuantizeNext,
    *,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    asm: bool | None = None,
    kernel: str | None = None,
    split_k: int | None = None,
) -> tuple[torch.Tensor, QuantizedRows]:
    """``linear_quantized`` and its output quantized for the next matmul, ``quantize(out, then.norm,
    then.eps)``: inside the matmul's launches where its kernel is "gemv_split", or "gemv" with K split
    over programs (its combine launch), and ``fuses_quantize`` (the program that stores a unit's last
    columns quantizes the unit: the whole row with a norm, 1,024 columns without), in a launch of its
    own otherwise. The same bits either way."""
    out, ahead = _linear(acts, w, residual, gated, asm, kernel, split_k, None, None, then)
    return out, ahead if ahead is not None else quantize(out, then.norm, then.eps)


def _linear(
    acts: QuantizedRows,
    w: Q1Weight,
    residual: torch.Tensor | None,
    gated: bool,
    asm: bool | None,
    kernel: str | None,
    split_k: int | None,
    block_n: int | None,
    group_dot: bool | None,
    then: QuantizeNext | None,
) -> tuple[torch.Tensor, QuantizedRows | None]:
    """``linear_quantized``'s work, and the output's quantization where the matmul's launch made it."""
    m = acts.rows
    out_rows = w.rows // 2 if gated else w.rows
    out = torch.empty(m, out_rows, dtype=torch.float32, device=acts.planes.device)
    if m == 0:
        return out, None
    if residual is not None:
        residual = residual.to(torch.float32)
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    if kernel is None and split_k is None and block_n is None and group_dot is None:
        tuned = q1_tuned.choice(out.device, m, out_rows, w.cols, gated)  # the GPU's measured form
        if tuned is not None:
            kernel, split_k, block_n, group_dot = (tuned.get(name) for name in q1_tuned.OPTION_NAMES)
    kernel = kernel or _default_kernel(m, out_rows, w.cols // QK, out.device)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    gemm = kernel.startswith("gemm")
    widths = gemm_block_ns(gated) if gemm else () if kernel == "gemv_split" else gemv_block_ns(m, gated)
    if block_n is not None and block_n not in widths:
        raise ValueError(f"block_n is a 'gemm' or 'gemv' tile's width, one of {widths} here; got {block_n}")
    if group_dot is not None and kernel != "gemm":
        raise ValueError(f"group_dot is the 'gemm' kernel's choice, not {kernel!r}'s")
    if gemm:
        expanded = kernel == "gemm_expanded"
        group_dot = expanded or (GEMM_GROUP_DOT if group_dot is None else group_dot)
        _gemm(acts, w, residual, gated, out, block_n, split_k, group_dot, expanded)
        return out, None
    asm = _asm_ok(acts.planes.device) if asm is None else asm
    most = FIXUP_MAX_M if kernel == "gemv_fixup" else GEMV_MAX_M
    if m > most:
        raise ValueError(f"the {kernel!r} kernel takes up to {most} activation rows, got {m}")
    fused = then if then is not None and fuses_quantize(out_rows) else None
    if kernel == "gemv_split":
        ahead = _gemv_split(
            acts, w, residual, gated, out, asm, split_k or _program_splits(w.cols // QK), fused
        )
        return out, ahead
    return out, _gemv(acts, w, residual, gated, out, asm, split_k, block_n, fused, kernel == "gemv_fixup")


def _gemv(
    acts: QuantizedRows,
    w: Q1Weight,
    residual: torch.Tensor | None,
    gated: bool,
    out: torch.Tensor,
    asm: bool,
    split_k: int | None = None,
    block_n: int | None = None,
    then: QuantizeNext | None = None,
    fixup: bool = False,
) -> QuantizedRows | None:
    """The GEMV into ``out``. Where K splits over programs, a combine launch adds the groups, or with
    ``fixup`` ("gemv_fixup") each tile's last program in the same launch; where also ``then`` is given
    and the rows are at most ``FUSED_COMBINE_MAX_M`` (``FIXUP_QUANTIZE_MAX_M``; above, Triton 3.9
    spilled the normed combine), the output is quantized there too (returned; None otherwise)."""
    m, out_rows = out.shape
    block_m = triton.next_power_of_2(m)
    block_n = block_n or gemv_rows(block_m, gated)
    n_tiles, groups = triton.cdiv(out_rows, block_n), w.cols // QK
    split_k, per_split, ones = _k_splits(split_k or _default_split_k(n_tiles, groups, out.device), w, out)
    combine_n = min(block_n, COMBINE_ELEMENTS // (block_m * (2 if gated else 1)))  # unspilled, at most
    fixup = fixup and split_k > 1
    quantizes = split_k > 1 and block_m <= (FIXUP_QUANTIZE_MAX_M if fixup else FUSED_COMBINE_MAX_M)
    then = then if quantizes else None
    fix_n = min(combine_n, FIXUP_COLUMNS)
    ahead, fixing = _fixup_args(then, out, n_tiles, block_n, fix_n) if fixup else (None, {})
    words = acts.planes.view(torch.int32)  # [2, M, K / 4]
    residual_or_out = residual if residual is not None else out
    _gemv_kernel[(n_tiles, split_k)](
        words, acts.scales, acts.sums, w.signs, w.scales, residual_or_out, out, ones,
        m, out_rows, w.cols, out_rows, per_split,
        words.stride(0), words.stride(1), acts.scales.stride(0), w.signs.stride(0), w.scales.stride(0),
        residual_or_out.stride(0), out.stride(0), ones.stride(0) if split_k > 1 else 0, ones.stride(-2),
        BLOCK_M=block_m, BLOCK_N=block_n, GATED=gated, RESIDUAL=residual is not None, SPLIT=split_k > 1,
        ASM=asm, **fixing, **pdl.launch(out.device), **_gemv_options(block_m),
    )  # fmt: skip
    if split_k == 1 or fixup:
        return ahead
    return _combine(ones, acts, w, residual, gated, out, block_m, combine_n, then)


def _fixup_args(
    then: QuantizeNext | None, out: torch.Tensor, n_tiles: int, block_n: int, fix_n: int
) -> tuple[QuantizedRows | None, dict[str, object]]:
    """``_gemv_kernel``'s fix-up arguments for a launch of ``n_tiles`` tiles ``block_n`` wide (their
    counts in ``tile_counts``, combined ``fix_n`` columns at a time), with the quantization's for
    ``then``, and the rows that quantization fills."""
    if n_tiles > TILE_COUNTS:
        raise ValueError(f"'gemv_fixup' counts at most {TILE_COUNTS} tiles, got {n_tiles}")
    ahead, quantizing = _quantize_args(then, out, block_n)
    return ahead, {"tiles_ptr": tile_counts(out.device), "FIXUP": True, "FIX_N": fix_n,
                   "FENCE": _fences(out.device), **quantizing}  # fmt: skip


def _k_splits(split_k: int, w: Q1Weight, out: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """K split over programs into about ``split_k`` parts: the splits (none empty), the groups each
    takes, and the integer sums' scratch ``[groups, M, w.rows]`` when split (``out`` otherwise, an
    unused pointer)."""
    groups = w.cols // QK
    per_split = triton.cdiv(groups, min(split_k, groups))
    split_k = triton.cdiv(groups, per_split)
    if split_k == 1:
        return 1, per_split, out
    return split_k, per_split, torch.empty(groups, out.shape[0], w.rows, dtype=torch.int32, device=out.device)


def _combine(
    ones: torch.Tensor,
    acts: QuantizedRows,
    w: Q1Weight,
    residual: torch.Tensor | None,
    gated: bool,
    out: torch.Tensor,
    block_m: int,
    block_n: int,
    then: QuantizeNext | None = None,
) -> QuantizedRows | None:
    """A split matmul's second launch: every group's integer sums ``ones [groups, M, w.rows]`` added in
    order into ``out`` with the epilogue, in ``block_m x block_n`` tiles; with ``then`` (one tile of
    rows) the output quantized for the next matmul too (returned)."""
    m, out_rows = out.shape
    if then is not None and block_m < m:
        raise ValueError(
            f"a combine that quantizes holds every row in one tile: {m} rows, tiles of {block_m}"
        )
    residual_or_out = residual if residual is not None else out
    ahead, quantizing = _quantize_args(then, out, block_n)
    _combine_kernel[(triton.cdiv(out_rows, block_n), triton.cdiv(m, block_m))](
        ones, acts.scales, acts.sums, w.scales, residual_or_out, out,
        m, out_rows, w.cols, out_rows,
        acts.scales.stride(0), w.scales.stride(0), residual_or_out.stride(0), out.stride(0),
        ones.stride(0), ones.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, GATED=gated, RESIDUAL=residual is not None,
        **quantizing, **pdl.launch(out.device), **NO_FUSION,
    )  # fmt: skip
    return ahead


def _default_kernel(m: int, out_rows: int, groups: int, device: torch.device) -> str:
    """The kernel for ``m`` rows: the GEMM above ``GEMV_MAX_M``; where K splits, the in-program split
    GEMV at one row (or ``one_row_gemv``'s choice) and the GEMV split over programs at 2-8 (module
    doc); the GEMV otherwise."""
    if m > GEMV_MAX_M:
        return "gemm"
    tiles = triton.cdiv(out_rows, gemv_rows(int(triton.next_power_of_2(m)), False))
    if _default_split_k(tiles, groups, device) == 1:
        return "gemv"
    return one_row_gemv() if m == 1 else "gemv"


def one_row_gemv() -> str:
    """The kernel of a one-row GEMV whose K splits: ``OXIBONSAI_ONE_ROW_GEMV``, for timing the forms in
    the model on a GPU, "gemv_split" (inside programs; the default), "gemv" (over programs, with a
    combine launch) or "gemv_fixup" (over programs, each tile combined by its last program)."""
    kernel = os.environ.get(ONE_ROW_ENV_VAR, "").strip() or "gemv_split"
    if kernel not in ONE_ROW_KERNELS:
        raise ValueError(f"{ONE_ROW_ENV_VAR} must be one of {ONE_ROW_KERNELS}, got {kernel!r}")
    return kernel


def _program_splits(groups: int) -> int:
    """K splits inside a "gemv_split" program: up to 16, a power of 2, at most the groups."""
    return min(16, 1 << (groups.bit_length() - 1))


def _gemv_split(
    acts: QuantizedRows,
    w: Q1Weight,
    residual: torch.Tensor | None,
    gated: bool,
    out: torch.Tensor,
    asm: bool,
    splits: int,
    then: QuantizeNext | None = None,
) -> QuantizedRows | None:
    """The in-program split GEMV into ``out``; with ``then``, its output quantized in the same launch
    (returned)."""
    if splits & (splits - 1) or not 1 <= splits <= SPLIT_TILE // 16:
        raise ValueError(f"'gemv_split' splits K in a power of 2 to {SPLIT_TILE // 16}, got {splits}")
    m, out_rows = out.shape
    groups, block_n = w.cols // QK, SPLIT_TILE // splits
    per_split = triton.cdiv(groups, splits)
    ones = torch.empty(groups, m, w.rows, dtype=torch.int32, device=out.device)
    words = acts.planes.view(torch.int32)
    residual_or_out = residual if residual is not None else out
    ahead, quantizing = _quantize_args(then, out, block_n)
    _gemv_split_kernel[(triton.cdiv(out_rows, block_n),)](
        words, acts.scales, acts.sums, w.signs, w.scales, residual_or_out, out, ones,
        m, out_rows, w.cols, out_rows, per_split,
        words.stride(0), words.stride(1), acts.scales.stride(0), w.signs.stride(0), w.scales.stride(0),
        residual_or_out.stride(0), out.stride(0), ones.stride(0), ones.stride(1),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, SPLITS=splits, GATED=gated,
        RESIDUAL=residual is not None, ASM=asm, GROUP_CHUNK=_group_chunk(m, per_split),
        num_warps=SPLIT_TILE // 32, **quantizing, **pdl.launch(out.device), **NO_FUSION,
    )  # fmt: skip
    return ahead


def _quantize_args(
    then: QuantizeNext | None, out: torch.Tensor, block_n: int
) -> tuple[QuantizedRows | None, dict[str, object]]:
    """The quantization arguments of ``_gemv_split_kernel`` and ``_combine_kernel`` for ``then`` (none
    without) and the rows they fill: units of ``QUANTIZE_UNIT`` columns (the whole row with a norm, or
    where the columns do not divide), whose programs count in ``arrival_counts``."""
    if then is None:
        return None, {}
    m, cols = out.shape
    ahead = QuantizedRows.empty(m, cols, out.device)
    unit = QUANTIZE_UNIT if then.norm is None and cols % QUANTIZE_UNIT == 0 else cols
    if unit < cols and (unit % block_n or cols // unit > ARRIVAL_COUNTS):
        unit = cols  # one unit: programs never straddle two
    args = {
        "norm_ptr": then.norm if then.norm is not None else out, "qplanes_ptr": ahead.planes,
        "qscales_ptr": ahead.scales, "qsums_ptr": ahead.sums, "counts_ptr": arrival_counts(out.device),
        "eps": then.eps, "unit_cols": unit, "stride_qp": ahead.planes.stride(0),
        "stride_qm": ahead.planes.stride(1), "stride_qs": ahead.scales.stride(0), "QUANTIZE": True,
        "QNORM": then.norm is not None, "NORM_CHUNK": min(triton.next_power_of_2(cols), NORM_CHUNK),
        "FENCE": _fences(out.device),
    }  # fmt: skip
    return ahead, args


def _fences(device: torch.device) -> bool:
    """Whether the kernels on ``device`` fence their stores before counting (PTX: CUDA only)."""
    return device.type == "cuda"


def device_counters(device: torch.device, name: str, size: int) -> torch.Tensor:
    """The zeroed int32 counters named ``name`` (``size`` of them) on ``device``, one set per device and
    name, created at the first call: the arrival counts of the kernels whose last program to arrive
    finishes their work (``q1_exact_kernels._last_to_arrive``), which leave them at zero."""
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else 0)
    return _counters_on(device, name, size)


@functools.cache
def _counters_on(device: torch.device, name: str, size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.int32, device=device)


def arrival_counts(device: torch.device) -> torch.Tensor:
    """The zeroed counters a launch that quantizes its output counts its programs in, one per unit of
    columns, one set per device: each launch leaves them at zero (the last program of a unit resets
    its count), and the launches that use them run one after another on the model's stream (with PDL
    a launch counts only after its grid-dependency wait, when the launch before has finished)."""
    return device_counters(device, "quantize units", ARRIVAL_COUNTS)


def tile_counts(device: torch.device) -> torch.Tensor:
    """The zeroed counters a "gemv_fixup" launch counts each tile's finished splits in, one per tile,
    one set per device, back at zero after each launch (as ``arrival_counts``, a set of their own)."""
    return device_counters(device, "gemv tiles", TILE_COUNTS)


def fuses_quantize(out_rows: int) -> bool:
    """Whether a GEMV launch of ``out_rows`` output columns quantizes them for the next matmul itself
    (where its kernel can): a whole number of 128-value blocks, unless ``OXIBONSAI_FUSE_QUANTIZE=0``."""
    return out_rows % QK == 0 and os.environ.get(FUSE_ENV_VAR, "1").strip() != "0"


def _group_chunk(m: int, per_split: int) -> int:
    """Groups of a "gemv_split" split in one stretch of straight code: all of Bonsai's (at most 6 with
    16 splits), so their loads are in flight together; one at 8 rows, where each group's store ends
    its loads' lives anyway (unrolled, the kernel only grows: ptxas took 12 s on one)."""
    return 1 if m > GEMV_MAX_M // 2 else min(per_split, GROUP_CHUNK)


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


def gemv_block_ns(m: int, gated: bool) -> tuple[int, ...]:
    """The "gemv" tile widths (weight rows per 4-warp program) at ``m`` activation rows: one weight row
    a thread, and two where ``gemv_rows`` gives two (one plain activation row)."""
    return tuple(sorted({128, gemv_rows(int(triton.next_power_of_2(m)), gated)}))


def _default_split_k(n_tiles: int, groups: int, device: torch.device) -> int:
    """Enough K splits for about ``PROGRAMS_PER_SM`` programs per SM on a GPU; none elsewhere."""
    if device.type != "cuda":
        return 1
    return max(1, min(groups, PROGRAMS_PER_SM * multiprocessors(device) // max(n_tiles, 1)))


def _gemm(
    acts: QuantizedRows,
    w: Q1Weight,
    residual: torch.Tensor | None,
    gated: bool,
    out: torch.Tensor,
    block_n: int | None,
    split_k: int | None,
    group_dot: bool,
    expanded: bool = False,
) -> None:
    m, out_rows = out.shape
    block_m = gemm_block_m(m)
    default_n, default_split = gemm_tiling(m, w, gated, out.device, block_n)
    block_n = block_n or default_n
    tiles = (triton.cdiv(m, block_m), triton.cdiv(out_rows, block_n))
    split_k, per_split, ones = _k_splits(split_k or default_split, w, out)
    columns = block_n * (2 if gated else 1)  # gate|up: two accumulators per tile
    residual_or_out = residual if residual is not None else out
    _gemm_kernel[(*tiles, split_k)](
        acts.planes, acts.scales, acts.sums, w.signs, w.scales, residual_or_out, out, ones,
        m, out_rows, w.cols, out_rows, per_split,
        acts.planes.stride(0), acts.planes.stride(1), acts.scales.stride(0), w.signs.stride(0),
        w.scales.stride(0), residual_or_out.stride(0), out.stride(0),
        ones.stride(0) if split_k > 1 else 0, ones.stride(-2),
        BLOCK_M=block_m, BLOCK_N=block_n, GATED=gated, RESIDUAL=residual is not None, SPLIT=split_k > 1,
        GROUP_DOT=group_dot, num_warps=8 if block_m * columns >= 64 * 64 else 4, **pdl.launch(out.device),
        **NO_FUSION, **({"bits_ptr": expand_bits(w), "EXPANDED": True} if expanded else {}),
    )  # fmt: skip
    if split_k > 1:
        _combine(ones, acts, w, residual, gated, out, min(block_m, COMBINE_BLOCK_M), COMBINE_BLOCK_N)


def expand_bits(w: Q1Weight) -> torch.Tensor:
    """``w``'s sign bits as 0/1 bytes ``[rows, cols]``, each 32-column stretch in the planes' dp4a order:
    the "gemm_expanded" kernel's bit tiles, loaded instead of built from the sign words in every
    program (one launch per matmul; 8 bits of traffic a weight, for prefill-sized M)."""
    bits = torch.empty(w.rows, w.cols, dtype=torch.int8, device=w.signs.device)
    _expand_kernel[(triton.cdiv(w.rows, EXPAND_ROWS), w.cols // 32)](
        w.signs, bits, w.rows, w.cols, w.signs.stride(0), BLOCK_N=EXPAND_ROWS
    )
    return bits


def gemm_tiling(
    m: int, w: Q1Weight, gated: bool, device: torch.device, block_n: int | None = None
) -> tuple[int, int]:
    """The GEMM's default tile width (``gemm_block_n``) and K split (``gemm_split_k``) for ``m`` rows
    of ``w`` on ``device``; the split for tiles ``block_n`` wide when given."""
    out_rows, groups, sms = w.rows // 2 if gated else w.rows, w.cols // QK, _gemm_sms(device)
    block_n = block_n or gemm_block_n(m, out_rows, gated, sms)
    tiles = triton.cdiv(m, gemm_block_m(m)) * triton.cdiv(out_rows, block_n)
    return block_n, gemm_split_k(tiles, groups, sms, 4 * groups * m * w.rows)


def gemm_split_k(tiles: int, groups: int, sms: int | None, scratch_bytes: int) -> int:
    """The GEMM's K splits over programs for a launch of ``tiles`` output tiles on a GPU of ``sms``
    SMs (None: not a GPU, none): none while the tiles fill ``GEMM_PROGRAMS_PER_SM`` programs per SM,
    otherwise enough to, keeping at least ``GEMM_MIN_SPLIT_GROUPS`` groups per split. A split GEMM's
    integer sums go through a scratch of ``scratch_bytes`` (every group's, ``4 * groups * M * N``) and
    a combine launch: none above ``GEMM_MAX_SCRATCH``, which should stay in L2 between the two (a
    512-token prefill's would be 67 MB for 1.7B's Q; it has tiles enough anyway)."""
    if sms is None or scratch_bytes > GEMM_MAX_SCRATCH:
        return 1
    wanted = triton.cdiv(GEMM_PROGRAMS_PER_SM * sms, tiles)
    return max(1, min(wanted, groups // GEMM_MIN_SPLIT_GROUPS))


def gemm_block_ns(gated: bool) -> tuple[int, ...]:
    """The GEMM tile widths, widest first (per half of a gate|up matrix)."""
    widest = GEMM_BLOCK_N // (2 if gated else 1)
    return tuple(n for n in (64, 32, 16) if GEMM_MIN_BLOCK_N <= n <= widest)


def gemm_block_n(m: int, out_rows: int, gated: bool, sms: int | None) -> int:
    """The GEMM tile's weight rows (per half of a gate|up matrix) for ``m`` activation rows on a GPU
    of ``sms`` SMs (None: not a GPU): ``GEMM_BLOCK_N`` (half for gate|up), halved while the launch
    would still fit one program per SM. Each program adds its 128-weight groups one after another,
    so at 9-128 rows (one tile of rows) a matrix with few wide tiles leaves most SMs idle (1.7B's O
    and down projections at 64 rows: 32 programs); a narrower tile spends more instructions per
    output on the activation tiles, on SMs that would idle. Never 16 with 16-row tiles, where
    Triton's 16-wide int8 tile costs more per program than the 32-wide one (SASS, sm_90: 1,484
    against 1,300 warp instructions a group). The bits never depend on it."""
    block_n = GEMM_BLOCK_N // (2 if gated else 1)
    if sms is None:
        return block_n
    block_m = gemm_block_m(m)
    narrowest = 32 if block_m == 16 else GEMM_MIN_BLOCK_N
    row_tiles = triton.cdiv(m, block_m)
    while block_n > narrowest and row_tiles * triton.cdiv(out_rows, block_n // 2) <= sms:
        block_n //= 2
    return block_n


def _gemm_sms(device: torch.device) -> int | None:
    return multiprocessors(device) if device.type == "cuda" else None


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
        cases = ((1, False, "gemv"), (1, True, "gemv_split"), (3, True, "gemv"), (5, False, "gemv_split"),
                 (8, False, "gemv"))  # fmt: skip
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

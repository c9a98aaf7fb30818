"""The Triton kernels of the exact-integer Q1 linear (``q1_exact``, which owns their launches and
documents the arithmetic): the activation quantization, the GEMV in its three forms (plain, K split
over programs with ``_combine_kernel``, K split inside each program) and the int8 GEMM. Each adds a
matrix's 128-weight blocks in the CPU engine's order; every float operation is written out (the
launches turn contraction off), so a row's bits never depend on the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from oxibonsai.torch_backend.ops.pdl import grid_dependency, prefetch_l2

L1_FIXED = tl.constexpr(65536.0)  # act.rs: fixed-point resolution of the L1 estimate
L1_BUDGET = tl.constexpr(32575.0)  # act.rs: the L1 budget a block's scale targets
MIN_AMAX = tl.constexpr(2.0**-96)  # act.rs: blocks whose largest magnitude is below this quantize to 0
FLT_MAX = tl.constexpr(3.4028234663852886e38)
NAN = tl.constexpr(float("nan"))
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + ROUND) - ROUND rounds |v| < 2^22 half to even
LANES = tl.constexpr(0x01010101)
COMBINE_CHUNK = tl.constexpr(16)  # groups whose integer sums a split GEMV's combine loads at once
QUANTIZE_UNIT_BLOCKS = tl.constexpr(8)  # 128-value blocks ``_quantize_when_last`` quantizes at once


@triton.jit
def _quantize_kernel(
    x_ptr, norm_ptr, planes_ptr, scales_ptr, sums_ptr,
    K, eps,
    stride_xm, stride_pp, stride_pm, stride_sm,
    BLOCKS: tl.constexpr, NORM_CHUNK: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Blocks ``BLOCKS * program_id(1)`` onwards of row ``program_id(0)`` of ``x`` (times its RMSNorm when
    ``NORM``) into ``QuantizedRows``: one ``[BLOCKS, 128]`` tile, a warp per block, so a block's
    reductions stay inside its warp and the row's blocks are quantized side by side, not one after
    another. With ``NORM`` every program of a row computes the row's mean square itself, all in the same
    order (the same bits in each, at every batch size)."""
    grid_dependency(PDL)
    m = tl.program_id(0)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    live = blocks < K // 128
    at = blocks[:, None] * 128 + tl.arange(0, 128)[None, :]
    row = x_ptr + m * stride_xm
    x = tl.load(row + at, mask=live[:, None], other=0.0).to(tl.float32)
    if NORM:
        weight = tl.load(norm_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
        x = x * _inverse_rms(row, K, eps, NORM_CHUNK, "") * weight
    _store_blocks(x, live, planes_ptr, scales_ptr, sums_ptr, m, blocks, stride_pp, stride_pm, stride_sm)


@triton.jit
def _inverse_rms(row, K, eps, CHUNK: tl.constexpr, CACHE: tl.constexpr):
    """``1 / sqrt(mean(row[:K]^2) + eps)``, the squares added in ``CHUNK`` lanes then across them, each
    division and the root correctly rounded as on the CPU; ``row`` loaded with cache modifier ``CACHE``."""
    squares = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, K, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        v = tl.load(row + offs, mask=offs < K, other=0.0, cache_modifier=CACHE).to(tl.float32)
        squares += v * v
    mean = tl.math.div_rn(tl.sum(squares), K.to(tl.float32))
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))


@triton.jit
def _store_block(x, planes_ptr, scales_ptr, sums_ptr, m, b, stride_pp, stride_pm, stride_sm):
    """Block ``b`` of row ``m`` (``x``: its 128 float32 values) quantized into ``QuantizedRows``' planes,
    scales and sums."""
    blocks = b + tl.arange(0, 1)
    live = blocks >= 0
    _store_blocks(x[None, :], live, planes_ptr, scales_ptr, sums_ptr, m, blocks, stride_pp, stride_pm,
                  stride_sm)  # fmt: skip


@triton.jit
def _store_blocks(x, live, planes_ptr, scales_ptr, sums_ptr, m, blocks, stride_pp, stride_pm, stride_sm):
    """Blocks ``blocks`` of row ``m`` (``x``: ``[B, 128]`` float32, a block per row; stored where
    ``live``) quantized into ``QuantizedRows``' planes, scales and sums."""
    cols = tl.arange(0, 128)[None, :]
    # column 32c + 8i + j goes to byte 32c + 4j + i: word 8c + j, lane i
    dest = (cols // 32) * 32 + (cols % 8) * 4 + (cols % 32) // 8
    q, scale = _quantize_blocks(x)
    low = (q << 24) >> 24
    high = (q - low) >> 8
    plane = planes_ptr + m * stride_pm + blocks[:, None] * 128 + dest
    tl.store(plane, high.to(tl.int8), mask=live[:, None])
    tl.store(plane + stride_pp, low.to(tl.int8), mask=live[:, None])
    tl.store(scales_ptr + m * stride_sm + blocks, scale, mask=live)
    tl.store(sums_ptr + m * stride_sm + blocks, tl.sum(q, axis=1), mask=live)


@triton.jit
def _quantize_blocks(x):
    """``act.rs``'s rule for each row of ``x`` (``[B, 128]``, a block per row): int32 ``q`` and the
    float32 scales ``[B]`` (0 for a block below ``MIN_AMAX``, NaN for one with a non-finite value,
    whose q are 0)."""
    ax = tl.abs(x)
    finite = tl.sum((ax <= FLT_MAX).to(tl.int32), axis=1) == 128  # NaN compares false
    amax = tl.max(ax, axis=1)
    used = finite & (amax >= MIN_AMAX)
    safe = tl.where(used, amax, 1.0)
    t = tl.sum(tl.floor(ax * tl.math.div_rn(L1_FIXED, safe)[:, None]).to(tl.int32), axis=1)
    scale = tl.math.div_rn((t + 128).to(tl.float32) * (safe * (1.0 / L1_FIXED)), L1_BUDGET)
    rounded = (x * tl.math.div_rn(1.0, scale)[:, None] + ROUND) - ROUND
    q = tl.where(used[:, None], rounded, 0.0).to(tl.int32)
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
def _ones(planes_ptr, signs_ptr, act_pairs, word_at, word_mask, stride_pp, zeros, ASM: tl.constexpr):
    """int32 tile shaped like ``zeros``: ``sum q`` over the set bits of one 128-group, for the weight
    rows whose group starts at sign word ``word_at`` (loaded where ``word_mask``) and the activation
    rows whose group starts at int64 ``act_pairs`` of the high plane, the low plane ``stride_pp``
    words on; ``word_at`` and ``act_pairs`` broadcast to the tile."""
    words = _group_words(signs_ptr, word_at, word_mask, zeros)
    return _ones_of(words, planes_ptr, signs_ptr, act_pairs, word_at, word_mask, stride_pp, zeros, ASM)


@triton.jit
def _group_words(signs_ptr, word_at, word_mask, zeros):
    """At one activation row (``zeros``: the tile), the four sign words of the group at ``word_at``,
    one 16-byte load a thread (``[..., 4]``); at more rows nothing (``_ones_of`` loads them itself)."""
    if zeros.shape[0] == 1:
        at = tl.expand_dims(word_at, -1) + tl.arange(0, 4)
        return tl.load(signs_ptr + at, mask=tl.expand_dims(word_mask, -1), other=0)
    else:
        return zeros


@triton.jit
def _ones_of(words, planes_ptr, signs_ptr, act_pairs, word_at, word_mask, stride_pp, zeros,
             ASM: tl.constexpr):  # fmt: skip
    """``_ones`` of the group whose sign words ``_group_words`` gave. At one activation row a thread
    reads the four words from one 16-byte load and each plane's activations two pairs a load (a
    quarter and half of the load instructions); at more rows Triton 3.6 spreads such loads over
    threads and converts layouts through shared memory (sm_90 SASS), so there each word and pair is a
    load of its own."""
    high = zeros
    low = zeros
    pairs = planes_ptr.to(tl.pointer_type(tl.int64))
    if zeros.shape[0] == 1:
        act_pairs = act_pairs + zeros  # the tile's shape, so a thread's two pairs are its own elements
    for w in tl.static_range(4):
        if zeros.shape[0] == 1:
            word = _pick(words, tl.arange(0, 4), w)
        else:
            word = tl.load(signs_ptr + word_at + w, mask=word_mask, other=0)
        for p in tl.static_range(4):
            if zeros.shape[0] == 1:
                if p % 2 == 0:
                    at = tl.expand_dims(act_pairs + w * 4 + p, -1) + tl.arange(0, 2)
                    high4 = tl.load(pairs + at)
                    low4 = tl.load(pairs + at + stride_pp // 2)
                high2 = _pick(high4, tl.arange(0, 2), p % 2)
                low2 = _pick(low4, tl.arange(0, 2), p % 2)
            else:
                high2 = tl.load(pairs + act_pairs + w * 4 + p)
                low2 = tl.load(pairs + act_pairs + stride_pp // 2 + w * 4 + p)
            for half in tl.static_range(2):
                bits = (word >> (2 * p + half)) & LANES
                high = _dot4(bits, (high2 >> (32 * half)).to(tl.int32), high, ASM)
                low = _dot4(bits, (low2 >> (32 * half)).to(tl.int32), low, ASM)
    return high * 256 + low


@triton.jit
def _pick(x, index, i):
    """``x[..., i]`` of an integer tile whose last axis is ``index`` (a thread's own elements)."""
    return tl.sum(tl.where(index == i, x, 0), axis=len(x.shape) - 1)


@triton.jit
def _gemv_kernel(
    planes_ptr, ascales_ptr, asums_ptr, signs_ptr, wscales_ptr, residual_ptr, out_ptr, ones_ptr,
    M, N, K, up_offset, groups_per_split,
    stride_pp, stride_pm, stride_am, stride_sn, stride_dn, stride_rm, stride_om, stride_og, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    tiles_ptr=None, FIXUP: tl.constexpr = False, FIX_N: tl.constexpr = 1,
    norm_ptr=None, qplanes_ptr=None, qscales_ptr=None, qsums_ptr=None, counts_ptr=None, eps=0.0, unit_cols=0,
    stride_qp=0, stride_qm=0, stride_qs=0,
    QUANTIZE: tl.constexpr = False, QNORM: tl.constexpr = False, NORM_CHUNK: tl.constexpr = 1,
    FENCE: tl.constexpr = False,
):  # fmt: skip
    """Rows ``n`` of program ``program_id(0)`` for every activation row ``m``, ``planes`` read as int32
    words; with ``GATED`` also rows ``n + up_offset``. ``SPLIT``: the program covers the groups of
    split ``program_id(1)`` and stores each group's integer sums at ``ones[g, m, n]`` for
    ``_combine_kernel``, or with ``FIXUP`` for the tile's last split to finish, which adds them in
    this launch (``_fix_up_when_last``: ``tiles_ptr`` and the arguments after ``FIX_N``, those of the
    quantization as in ``_gemv_split_kernel``); otherwise it covers every
    group, combines them and stores ``out[m, n]``. At one row each group's sign words load during
    the group before the one before (``_group_words``)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    first = tl.program_id(1) * groups_per_split
    last = tl.minimum(first + groups_per_split, K // 128)
    rows = tl.minimum(offs_n, N - 1)
    _prefetch_rows(signs_ptr, wscales_ptr, rows, first, last - first, K // 128, up_offset, stride_sn,
                   stride_dn, GATED, PDL)  # fmt: skip
    grid_dependency(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    words_mask = mask_n[None, :]
    word_at = (offs_n * stride_sn)[None, :]
    up_at = word_at + up_offset * stride_sn
    words, words_up = _rows_words(signs_ptr, word_at, up_at, first, last, words_mask, zeros, GATED)
    words_next, words_up_next = _rows_words(signs_ptr, word_at, up_at, first + 1, last, words_mask, zeros,
                                            GATED)  # fmt: skip
    for g in range(first, last):
        # at one row the sign words of the group after next load now: ptxas issues them after this
        # group's work, so they have the next group's work to arrive in
        words_after, words_up_after = _rows_words(signs_ptr, word_at, up_at, g + 2, last, words_mask, zeros,
                                                  GATED)  # fmt: skip
        act_pairs = (offs_m * (stride_pm // 2) + g * 16)[:, None]
        ones = _ones_of(words, planes_ptr, signs_ptr, act_pairs, word_at + g * 4, words_mask, stride_pp,
                        zeros, ASM)  # fmt: skip
        ones_up = ones
        if GATED:
            ones_up = _ones_of(words_up, planes_ptr, signs_ptr, act_pairs, up_at + g * 4, words_mask,
                               stride_pp, zeros, ASM)  # fmt: skip
        acc, acc_up = _take_group(
            acc, acc_up, ones, ones_up, ones_ptr, asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n,
            mask_n, g, up_offset, stride_am, stride_dn, stride_og, stride_on, GATED, SPLIT,
        )  # fmt: skip
        words, words_up = words_next, words_up_next
        words_next, words_up_next = words_after, words_up_after
    if not SPLIT:
        _store_out(acc, acc_up, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_rm, stride_om,
                   GATED, RESIDUAL)  # fmt: skip
    if FIXUP:
        _fix_up_when_last(
            ones_ptr, asums_ptr, ascales_ptr, wscales_ptr, residual_ptr, out_ptr, tiles_ptr, M, N, K,
            up_offset, stride_am, stride_dn, stride_og, stride_on, stride_rm, stride_om,
            norm_ptr, qplanes_ptr, qscales_ptr, qsums_ptr, counts_ptr, eps, unit_cols, stride_qp, stride_qm,
            stride_qs, BLOCK_M, BLOCK_N, FIX_N, GATED, RESIDUAL, QUANTIZE, QNORM, NORM_CHUNK, FENCE,
        )  # fmt: skip


@triton.jit
def _rows_words(signs_ptr, word_at, up_at, g, last, mask, zeros, GATED: tl.constexpr):
    """``_group_words`` of group ``g`` (the last, ``last - 1``, past it) for the weight rows at
    ``word_at``, and for their up rows at ``up_at`` with ``GATED`` (else the same words again)."""
    at = tl.minimum(g, last - 1) * 4
    words = _group_words(signs_ptr, word_at + at, mask, zeros)
    words_up = _group_words(signs_ptr, up_at + at, mask, zeros) if GATED else words
    return words, words_up


@triton.jit
def _fix_up_when_last(
    ones_ptr, asums_ptr, ascales_ptr, wscales_ptr, residual_ptr, out_ptr, tiles_ptr, M, N, K,
    up_offset, stride_am, stride_dn, stride_og, stride_on, stride_rm, stride_om,
    norm_ptr, qplanes_ptr, qscales_ptr, qsums_ptr, counts_ptr, eps, unit_cols, stride_qp, stride_qm,
    stride_qs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FIX_N: tl.constexpr, GATED: tl.constexpr,
    RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr, QNORM: tl.constexpr, NORM_CHUNK: tl.constexpr,
    FENCE: tl.constexpr,
):  # fmt: skip
    """Called by each split program of a "gemv_fixup" launch once its groups' integer sums are stored:
    the program that stores its tile's last split, whichever it is, adds every group of the tile in
    order and runs the epilogue, ``FIX_N`` columns at a time (what ``_combine_kernel`` would do in a
    launch of its own), then with ``QUANTIZE`` counts the tile towards quantizing its unit of columns
    (``_quantize_when_last``). Each program adds one to ``tiles[program_id(0)]``; the one that brings
    it to the splits resets it to 0 for the next launch. ``FENCE`` as in ``_quantize_when_last``; the
    sums load from L2."""
    tile = tl.program_id(0)
    if _last_to_arrive(tiles_ptr + tile, tl.num_programs(1), FENCE):
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        for c in tl.static_range(BLOCK_N // FIX_N):
            offs_n = tile * BLOCK_N + c * FIX_N + tl.arange(0, FIX_N)
            _combine_groups_and_store(
                ones_ptr, asums_ptr, ascales_ptr, wscales_ptr, residual_ptr, out_ptr, offs_m, mask_m, offs_n,
                offs_n < N, K // 128, up_offset, stride_am, stride_dn, stride_og, stride_on, stride_rm,
                stride_om, BLOCK_M, FIX_N, GATED, RESIDUAL, ".cg",
            )  # fmt: skip
        if QUANTIZE:
            _quantize_when_last(
                out_ptr, norm_ptr, qplanes_ptr, qscales_ptr, qsums_ptr, counts_ptr, M, N, eps, tile * BLOCK_N,
                unit_cols, BLOCK_N, stride_om, stride_qp, stride_qm, stride_qs, QNORM, NORM_CHUNK, FENCE,
            )  # fmt: skip


@triton.jit
def _take_group(
    acc, acc_up, ones, ones_up, ones_ptr, asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n, mask_n,
    g, up_offset, stride_am, stride_dn, stride_og, stride_on, GATED: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Group ``g``'s integer sums ``ones`` (and ``ones_up``) stored at ``ones[g, m, n]`` for
    ``_combine_kernel`` when ``SPLIT``, otherwise added to ``acc`` (and ``acc_up``), which it returns."""
    if SPLIT:
        at = ones_ptr + g * stride_og + offs_m[:, None] * stride_on + offs_n[None, :]
        tl.store(at, ones, mask=mask_m[:, None] & mask_n[None, :])
        if GATED:
            tl.store(at + up_offset, ones_up, mask=mask_m[:, None] & mask_n[None, :])
    else:
        acc, acc_up = _combine_group(
            acc, acc_up, ones, ones_up, asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n, mask_n,
            g, up_offset, stride_am, stride_dn, GATED,
        )  # fmt: skip
    return acc, acc_up


@triton.jit
def _gemv_split_kernel(
    planes_ptr, ascales_ptr, asums_ptr, signs_ptr, wscales_ptr, residual_ptr, out_ptr, ones_ptr,
    M, N, K, up_offset, groups_per_split,
    stride_pp, stride_pm, stride_am, stride_sn, stride_dn, stride_rm, stride_om, stride_og, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, GATED: tl.constexpr,
    RESIDUAL: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, GROUP_CHUNK: tl.constexpr,
    norm_ptr=None, qplanes_ptr=None, qscales_ptr=None, qsums_ptr=None, counts_ptr=None, eps=0.0, unit_cols=0,
    stride_qp=0, stride_qm=0, stride_qs=0,
    QUANTIZE: tl.constexpr = False, QNORM: tl.constexpr = False, NORM_CHUNK: tl.constexpr = 1,
    FENCE: tl.constexpr = False,
):  # fmt: skip
    """Rows ``n`` of program ``program_id(0)`` for every activation row ``m``, with K split inside the
    program: the ``[SPLITS, BLOCK_N]`` tile's row ``s`` takes groups ``s * groups_per_split`` onwards
    (every activation row in the same thread, as in ``_gemv_kernel``) and stores each group's integer
    sums at ``ones[g, m, n]``; after a barrier the program adds every group in order. For matrices with
    too few rows to fill the GPU, one launch instead of the split GEMV's two. A split's groups go
    ``GROUP_CHUNK`` at a time through straight code, and below 8 rows a chunk's sums are stored after
    its last group's loads, so the loads of all its groups can be in flight at once. With ``QUANTIZE``
    the output is also quantized for the next matmul (``_quantize_when_last``; the arguments after
    ``GROUP_CHUNK``)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    groups = K // 128
    first = tl.arange(0, SPLITS)[:, None] * groups_per_split
    _prefetch_rows(signs_ptr, wscales_ptr, tl.minimum(offs_n, N - 1)[None, :], first, groups_per_split,
                   groups, up_offset, stride_sn, stride_dn, GATED, PDL)  # fmt: skip
    grid_dependency(PDL)
    split = tl.arange(0, SPLITS)[None, :, None]
    rows_n = offs_n[None, None, :]
    rows_m = offs_m[:, None, None]
    mask = (split < SPLITS) & (rows_n < N)  # [1, SPLITS, BLOCK_N]
    zeros = tl.zeros([BLOCK_M, SPLITS, BLOCK_N], dtype=tl.int32)
    for chunk in range(0, groups_per_split, GROUP_CHUNK):
        _split_chunk(planes_ptr, signs_ptr, ones_ptr, M, chunk, groups_per_split, groups, up_offset, split,
                     rows_m, rows_n, mask, zeros, stride_pp, stride_pm, stride_sn, stride_og, stride_on,
                     BLOCK_M, GATED, ASM, GROUP_CHUNK)  # fmt: skip
    tl.debug_barrier()  # the program's stores are visible to all its threads
    _combine_groups_and_store(
        ones_ptr, asums_ptr, ascales_ptr, wscales_ptr, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n,
        groups, up_offset, stride_am, stride_dn, stride_og, stride_on, stride_rm, stride_om,
        BLOCK_M, BLOCK_N, GATED, RESIDUAL, "",
    )  # fmt: skip
    if QUANTIZE:
        _quantize_when_last(
            out_ptr, norm_ptr, qplanes_ptr, qscales_ptr, qsums_ptr, counts_ptr, M, N, eps,
            tl.program_id(0) * BLOCK_N, unit_cols, BLOCK_N, stride_om, stride_qp, stride_qm, stride_qs,
            QNORM, NORM_CHUNK, FENCE,
        )  # fmt: skip


@triton.jit
def _quantize_when_last(
    out_ptr, norm_ptr, planes_ptr, scales_ptr, sums_ptr, counts_ptr, M, N, eps, first_col, unit_cols, block_n,
    stride_om, stride_pp, stride_pm, stride_sm, NORM: tl.constexpr, NORM_CHUNK: tl.constexpr,
    FENCE: tl.constexpr,
):  # fmt: skip
    """Called by each program once it has stored its ``block_n`` columns from ``first_col`` of ``out``
    (every row, ``M``; ``N`` columns): the ``unit_cols`` columns they lie in (a multiple of
    ``block_n``; the whole row with ``NORM``) are quantized into ``QuantizedRows`` (``act.rs``'s rule,
    RMS-normalized first with weight ``norm`` when ``NORM``, exactly as ``_quantize_kernel``) by the
    program that stores the unit's last columns, whichever it is: each program adds one to
    ``counts[unit]`` and the one that brings it to the unit's programs resets it to 0 for the next
    launch and quantizes. ``FENCE`` (on a GPU) makes every thread's stores visible device-wide before
    the count, and the others' visible to it after; the quantizing program reads ``out`` from L2."""
    unit = first_col // unit_cols
    start = unit * unit_cols
    cols = tl.minimum(unit_cols, N - start)
    if _last_to_arrive(counts_ptr + unit, tl.cdiv(cols, block_n), FENCE):
        first_block, end_block = start // 128, (start + cols) // 128
        for m in range(M):
            row = out_ptr + m * stride_om
            inverse = 1.0
            if NORM:
                inverse = _inverse_rms(row, N, eps, NORM_CHUNK, ".cg")
            for b in range(first_block, end_block, QUANTIZE_UNIT_BLOCKS):
                blocks = b + tl.arange(0, QUANTIZE_UNIT_BLOCKS)
                live = blocks < end_block
                at = blocks[:, None] * 128 + tl.arange(0, 128)[None, :]
                x = tl.load(row + at, mask=live[:, None], other=0.0, cache_modifier=".cg")
                if NORM:
                    weight = tl.load(norm_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
                    x = x * inverse * weight
                _store_blocks(x, live, planes_ptr, scales_ptr, sums_ptr, m, blocks, stride_pp, stride_pm,
                              stride_sm)  # fmt: skip


@triton.jit
def _last_to_arrive(counter_ptr, arrivals, FENCE: tl.constexpr):
    """Whether this program is the last of the ``arrivals`` programs that count at ``counter_ptr``
    (which then resets it to 0 for the next launch): each thread's stores before the call are
    made visible device-wide before the count (``FENCE``, on a GPU), and the last program sees the
    others' after it (the count is acquire-release, GPU scope)."""
    _fence(FENCE)
    tl.debug_barrier()  # every thread's stores are made before the count
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == arrivals - 1
    if last:
        tl.store(counter_ptr, 0)
        _fence(FENCE)
    tl.debug_barrier()
    return last


@triton.jit
def _fence(FENCE: tl.constexpr):
    """``fence.acq_rel.gpu`` in every thread when ``FENCE`` (CUDA only: the interpreter runs programs one
    after another and has no PTX)."""
    if FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _split_chunk(
    planes_ptr, signs_ptr, ones_ptr, M, chunk, groups_per_split, groups, up_offset, split, rows_m, rows_n,
    mask, zeros, stride_pp, stride_pm, stride_sn, stride_og, stride_on,
    BLOCK_M: tl.constexpr, GATED: tl.constexpr, ASM: tl.constexpr, GROUP_CHUNK: tl.constexpr,
):  # fmt: skip
    """``_gemv_split_kernel``'s groups ``chunk`` to ``chunk + GROUP_CHUNK`` of each split: their integer
    sums stored at ``ones[g, m, n]``."""
    held = ()  # below 8 rows the chunk's sums are stored last: a store would keep the next group's
    for j in tl.static_range(GROUP_CHUNK):  # loads waiting behind it (they may alias)
        g, valid, at = _split_group(chunk + j, groups_per_split, groups, split, rows_m, rows_n, mask, M,
                                    ones_ptr, stride_og, stride_on)  # fmt: skip
        word_at = rows_n * stride_sn + g * 4
        act_pairs = rows_m * (stride_pm // 2) + g * 16  # the planes hold BLOCK_M rows
        ones = _ones(planes_ptr, signs_ptr, act_pairs, word_at, mask, stride_pp, zeros, ASM)
        if BLOCK_M >= 8:  # the store ends the activation loads' lives: fewer registers, more loads
            tl.store(at, ones, mask=valid)
        ones_up = ones
        if GATED:  # otherwise before any store, so the up rows reuse the activation loads
            up_at = word_at + up_offset * stride_sn
            ones_up = _ones(planes_ptr, signs_ptr, act_pairs, up_at, mask, stride_pp, zeros, ASM)
            if BLOCK_M >= 8:
                tl.store(at + up_offset, ones_up, mask=valid)
        if BLOCK_M < 8:
            held = held + ((ones, ones_up),)  # noqa: RUF005 (Triton's frontend: no starred tuples)
    if BLOCK_M < 8:
        for j in tl.static_range(GROUP_CHUNK):
            _, valid, at = _split_group(chunk + j, groups_per_split, groups, split, rows_m, rows_n, mask, M,
                                        ones_ptr, stride_og, stride_on)  # fmt: skip
            ones, ones_up = held[j]
            tl.store(at, ones, mask=valid)
            if GATED:
                tl.store(at + up_offset, ones_up, mask=valid)


@triton.jit
def _split_group(j, groups_per_split, groups, split, rows_m, rows_n, mask, M, ones_ptr, stride_og, stride_on):
    """Group ``j`` of each split: its index (clamped: past the end, a real group's loads, never
    stored), where its sums are stored, and where they are real."""
    in_split = split * 0 + j < groups_per_split  # a tensor, as ``j`` may be a plain int here
    g = split * groups_per_split + j
    valid = mask & in_split & (g < groups) & (rows_m < M)
    g = tl.minimum(g, groups - 1)
    return g, valid, ones_ptr + g * stride_og + rows_m * stride_on + rows_n


@triton.jit
def _prefetch_rows(signs_ptr, wscales_ptr, rows, first, count, groups, up_offset, stride_sn, stride_dn,
                   GATED: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """With ``PDL``, asks L2 for weight rows ``rows``' sign words and scales of the ``count`` groups
    from ``first`` (broadcast with ``rows``; clamped to the matrix), and the up rows' with ``GATED``:
    one hint per 128-byte line of sign words (8 groups), and the first line of scales."""
    if PDL:
        for r in tl.static_range(2 if GATED else 1):
            at = rows + r * up_offset
            for g in range(0, count, 8):
                group = tl.minimum(first + g, groups - 1)
                prefetch_l2(signs_ptr + at * stride_sn + group * 4, PDL)
            prefetch_l2(wscales_ptr + at * stride_dn + tl.minimum(first, groups - 1), PDL)


@triton.jit
def _combine_groups_and_store(
    ones_ptr, asums_ptr, ascales_ptr, wscales_ptr, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n,
    groups, up_offset, stride_am, stride_dn, stride_og, stride_on, stride_rm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    CACHE: tl.constexpr,
):  # fmt: skip
    """A ``[BLOCK_M, BLOCK_N]`` tile of ``out`` from every group's integer sums ``ones[g, m, n]``,
    added in order, and the epilogue. The groups go ``COMBINE_CHUNK`` at a time through straight code,
    so their loads wait for memory once per chunk rather than once per few groups (at one row the
    program is alone on its SM and nothing else hides the wait). ``ones`` loads with cache modifier
    ``CACHE`` (".cg", from L2, where other programs stored them)."""
    mask = mask_m[:, None] & mask_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for first in range(0, groups, COMBINE_CHUNK):
        chunk = ()  # every load of the chunk first, then the additions in order
        for j in tl.static_range(COMBINE_CHUNK):
            g = tl.minimum(first + j, groups - 1)  # past the end: a real group's loads, not added
            at = ones_ptr + g * stride_og + offs_m[:, None] * stride_on + offs_n[None, :]
            ones = tl.load(at, mask=mask, other=0, cache_modifier=CACHE)
            ones_up = ones
            if GATED:
                ones_up = tl.load(at + up_offset, mask=mask, other=0, cache_modifier=CACHE)
            scales = _group_scales(asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n, mask_n, g,
                                   up_offset, stride_am, stride_dn, GATED)  # fmt: skip
            chunk = chunk + ((ones, ones_up, scales),)  # noqa: RUF005 (Triton's frontend: no starred tuples)
        for j in tl.static_range(COMBINE_CHUNK):
            ones, ones_up, scales = chunk[j]
            added, added_up = _combine_scaled(acc, acc_up, ones, ones_up, scales, GATED)
            live = first + j < groups
            acc = tl.where(live, added, acc)
            acc_up = tl.where(live, added_up, acc_up)
    _store_out(acc, acc_up, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_rm, stride_om,
               GATED, RESIDUAL)  # fmt: skip


@triton.jit
def _combine_group(
    acc, acc_up, ones, ones_up, asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n, mask_n,
    g, up_offset, stride_am, stride_dn, GATED: tl.constexpr,
):  # fmt: skip
    """``acc`` (and ``acc_up``) after group ``g``: ``[BLOCK_M, BLOCK_N]`` tiles."""
    scales = _group_scales(asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n, mask_n, g, up_offset,
                           stride_am, stride_dn, GATED)  # fmt: skip
    return _combine_scaled(acc, acc_up, ones, ones_up, scales, GATED)


@triton.jit
def _group_scales(asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n, mask_n, g, up_offset,
                  stride_am, stride_dn, GATED: tl.constexpr):  # fmt: skip
    """Group ``g``'s activation sums and scales (``[BLOCK_M, 1]``) and weight scales (``[1, BLOCK_N]``,
    the up rows' too with ``GATED``)."""
    block_sums = tl.load(asums_ptr + offs_m * stride_am + g, mask=mask_m, other=0)[:, None]
    d_a = tl.load(ascales_ptr + offs_m * stride_am + g, mask=mask_m, other=0.0)[:, None]
    d_w = tl.load(wscales_ptr + offs_n * stride_dn + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    d_up = d_w
    if GATED:
        d_up = tl.load(wscales_ptr + (offs_n + up_offset) * stride_dn + g, mask=mask_n, other=0.0)
        d_up = d_up.to(tl.float32)[None, :]
    return block_sums, d_a, d_w, d_up


@triton.jit
def _combine_scaled(acc, acc_up, ones, ones_up, scales, GATED: tl.constexpr):
    """``acc`` (and ``acc_up``) after the group whose integer sums are ``ones`` and whose
    ``_group_scales`` are ``scales``."""
    block_sums, d_a, d_w, d_up = scales
    acc = _combine(acc, ones, block_sums, d_w * d_a)
    if GATED:
        acc_up = _combine(acc_up, ones_up, block_sums, d_up * d_a)
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
    PDL: tl.constexpr,
    norm_ptr=None, qplanes_ptr=None, qscales_ptr=None, qsums_ptr=None, counts_ptr=None, eps=0.0, unit_cols=0,
    stride_qp=0, stride_qm=0, stride_qs=0,
    QUANTIZE: tl.constexpr = False, QNORM: tl.constexpr = False, NORM_CHUNK: tl.constexpr = 1,
    FENCE: tl.constexpr = False,
):  # fmt: skip
    """A split GEMV's or GEMM's second half: every group's integer sums ``ones[g, m, n]`` combined in
    order, then the epilogue, for rows ``n`` of program ``program_id(0)`` and activation rows ``m`` of
    program ``program_id(1)``. With ``QUANTIZE`` (one tile of activation rows: a GEMV's) the output is
    also quantized for the next matmul, as in ``_gemv_split_kernel``."""
    grid_dependency(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    _combine_groups_and_store(
        ones_ptr, asums_ptr, ascales_ptr, wscales_ptr, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n,
        K // 128, up_offset, stride_am, stride_dn, stride_og, stride_on, stride_rm, stride_om,
        BLOCK_M, BLOCK_N, GATED, RESIDUAL, "",
    )  # fmt: skip
    if QUANTIZE:
        _quantize_when_last(
            out_ptr, norm_ptr, qplanes_ptr, qscales_ptr, qsums_ptr, counts_ptr, M, N, eps,
            tl.program_id(0) * BLOCK_N, unit_cols, BLOCK_N, stride_om, stride_qp, stride_qm, stride_qs,
            QNORM, NORM_CHUNK, FENCE,
        )  # fmt: skip


@triton.jit
def _gemm_kernel(
    planes_ptr, ascales_ptr, asums_ptr, signs_ptr, wscales_ptr, residual_ptr, out_ptr, ones_ptr,
    M, N, K, up_offset, groups_per_split,
    stride_pp, stride_pm, stride_am, stride_sn, stride_dn, stride_rm, stride_om, stride_og, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr, GROUP_DOT: tl.constexpr, PDL: tl.constexpr,
    bits_ptr=None, EXPANDED: tl.constexpr = False,
):  # fmt: skip
    """``out[m, n]`` for one ``BLOCK_M x BLOCK_N`` tile, the epilogue included: each 128-weight group's
    integer sums from int8 ``tl.dot``s of both planes with 0/1 byte tiles of the weights' bits, in the
    planes' dp4a order (``GROUP_DOT``: one ``[128, BLOCK_N]`` tile and one dot per plane for the whole
    group; otherwise a ``[32, BLOCK_N]`` tile per sign word); with ``GATED`` the up rows
    ``n + up_offset`` too, on the same activation tiles. ``SPLIT``: the program takes the groups of
    split ``program_id(2)`` and stores each group's sums at ``ones[g, m, n]`` for ``_combine_kernel``.
    ``EXPANDED`` (with ``GROUP_DOT``): the bit tiles are loaded from ``bits`` (``_expand_kernel``'s 0/1
    bytes, ``[rows, K]``), not built from the sign words."""
    grid_dependency(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    first = tl.program_id(2) * groups_per_split
    last = tl.minimum(first + groups_per_split, K // 128)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(first, last):
        ones, ones_up = _gemm_group(
            planes_ptr, signs_ptr, bits_ptr, offs_m, mask_m, offs_n, mask_n, g, K, up_offset, stride_pp,
            stride_pm, stride_sn, BLOCK_M, BLOCK_N, GATED, GROUP_DOT, EXPANDED,
        )  # fmt: skip
        acc, acc_up = _take_group(
            acc, acc_up, ones, ones_up, ones_ptr, asums_ptr, ascales_ptr, wscales_ptr, offs_m, mask_m, offs_n,
            mask_n, g, up_offset, stride_am, stride_dn, stride_og, stride_on, GATED, SPLIT,
        )  # fmt: skip
    if not SPLIT:
        _store_out(acc, acc_up, residual_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_rm, stride_om,
                   GATED, RESIDUAL)  # fmt: skip


@triton.jit
def _gemm_group(
    planes_ptr, signs_ptr, bits_ptr, offs_m, mask_m, offs_n, mask_n, g, K, up_offset, stride_pp, stride_pm,
    stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, GROUP_DOT: tl.constexpr,
    EXPANDED: tl.constexpr,
):  # fmt: skip
    """Group ``g``'s integer sums ``sum q`` over the set bits, ``[BLOCK_M, BLOCK_N]`` (and the up
    rows' with ``GATED``): ``256 * high + low`` of the two planes' dots."""
    high = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    low = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    high_up = high
    low_up = low
    words = offs_n * stride_sn + g * 4
    DEPTH: tl.constexpr = 128 if GROUP_DOT else 32
    for w in tl.static_range(128 // DEPTH):
        cols = g * 128 + w * DEPTH + tl.arange(0, DEPTH)[None, :]
        acts = planes_ptr + offs_m[:, None] * stride_pm + cols
        a_high = tl.load(acts, mask=mask_m[:, None], other=0)
        a_low = tl.load(acts + stride_pp, mask=mask_m[:, None], other=0)
        if EXPANDED:
            bits = _expanded_tile(bits_ptr, offs_n, mask_n, g * 128, K, DEPTH)
        else:
            bits = _bit_tile(signs_ptr, words + w, mask_n, DEPTH)
        high = tl.dot(a_high, bits, high, out_dtype=tl.int32)
        low = tl.dot(a_low, bits, low, out_dtype=tl.int32)
        if GATED:
            if EXPANDED:
                bits_up = _expanded_tile(bits_ptr, offs_n + up_offset, mask_n, g * 128, K, DEPTH)
            else:
                bits_up = _bit_tile(signs_ptr, words + up_offset * stride_sn + w, mask_n, DEPTH)
            high_up = tl.dot(a_high, bits_up, high_up, out_dtype=tl.int32)
            low_up = tl.dot(a_low, bits_up, low_up, out_dtype=tl.int32)
    return high * 256 + low, high_up * 256 + low_up


@triton.jit
def _bit_tile(signs_ptr, word_at, mask_n, DEPTH: tl.constexpr):
    """int8 ``[DEPTH, BLOCK_N]`` (32: one sign word per column, at ``word_at``; 128: the four from
    ``word_at``): the 0/1 bits in the planes' dp4a order, row ``r`` holding bit ``8 (r % 4) + (r % 32) //
    4`` of word ``r // 32`` (byte ``4j + i`` of a 32-column stretch is its column ``8i + j``)."""
    pos = tl.arange(0, DEPTH)
    word = tl.load(signs_ptr + word_at[None, :] + (pos // 32)[:, None], mask=mask_n[None, :], other=0)
    return ((word >> (8 * (pos % 4) + (pos % 32) // 4)[:, None]) & 1).to(tl.int8)


@triton.jit
def _expanded_tile(bits_ptr, rows, mask_n, start, K, DEPTH: tl.constexpr):
    """int8 ``[DEPTH, BLOCK_N]``: columns ``start`` onwards of ``bits`` (``[rows, K]``, 0/1 bytes in the
    planes' dp4a order) for weight rows ``rows``, as ``_bit_tile`` would build them."""
    cols = start + tl.arange(0, DEPTH)
    return tl.load(bits_ptr + rows[None, :] * K + cols[:, None], mask=mask_n[None, :], other=0)


@triton.jit
def _expand_kernel(signs_ptr, bits_ptr, N, K, stride_sn, BLOCK_N: tl.constexpr):
    """Rows ``BLOCK_N * program_id(0)`` onwards of the sign words as 0/1 bytes ``bits [N, K]``, each
    32-column stretch in the planes' dp4a order (byte ``32c + r`` is bit ``8 (r % 4) + r // 4`` of word
    ``c``), sign word ``program_id(1)`` of each row."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    word_at = tl.program_id(1)
    live = rows < N
    word = tl.load(signs_ptr + rows * stride_sn + word_at, mask=live, other=0)
    r = tl.arange(0, 32)
    bits = (word[:, None] >> (8 * (r % 4) + r // 4)[None, :]) & 1
    tl.store(bits_ptr + rows[:, None] * K + word_at * 32 + r[None, :], bits.to(tl.int8), mask=live[:, None])

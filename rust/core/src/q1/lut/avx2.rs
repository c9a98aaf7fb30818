//! AVX2 LUT kernels. One 32-byte load gives the table indices of 32 rows for two weight groups; four
//! `vpshufb` look up the low and high bytes of both groups' entries, which are interleaved back into
//! int16 and summed exactly per 128-block.
//!
//! Row order inside the int16 accumulators: `lo` holds rows 0..8 (low half) and 16..24 (high half),
//! `hi` holds rows 8..16 and 24..32, because `vpunpck*bw` works per 128-bit half.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{LutPacked, TABLE_BYTES, TILE_BLOCK_BYTES, TILE_ROWS};

/// Columns whose tables share one extraction of weight indices in the GEMM.
const GEMM_COLS: usize = 4;

#[inline(always)]
unsafe fn table(tables: *const u8, g: usize) -> (__m256i, __m256i) {
    let t = tables.add(g * TABLE_BYTES);
    (
        _mm256_broadcastsi128_si256(_mm_loadu_si128(t.cast())),
        _mm256_broadcastsi128_si256(_mm_loadu_si128(t.add(16).cast())),
    )
}

/// Adds the entries of groups `2c` and `2c + 1` selected by `bits` (32 rows) to the accumulators.
#[inline(always)]
unsafe fn accumulate_chunk(i0: __m256i, i1: __m256i, tables: *const u8, c: usize, acc: &mut [__m256i; 2]) {
    let (t0lo, t0hi) = table(tables, 2 * c);
    let (t1lo, t1hi) = table(tables, 2 * c + 1);
    let (l0, h0) = (_mm256_shuffle_epi8(t0lo, i0), _mm256_shuffle_epi8(t0hi, i0));
    let (l1, h1) = (_mm256_shuffle_epi8(t1lo, i1), _mm256_shuffle_epi8(t1hi, i1));
    let lo = _mm256_add_epi16(_mm256_unpacklo_epi8(l0, h0), _mm256_unpacklo_epi8(l1, h1));
    let hi = _mm256_add_epi16(_mm256_unpackhi_epi8(l0, h0), _mm256_unpackhi_epi8(l1, h1));
    acc[0] = _mm256_add_epi16(acc[0], lo);
    acc[1] = _mm256_add_epi16(acc[1], hi);
}

/// Tile-blocks ahead of the current one whose weights are prefetched into L2 (the `T1` hint): the
/// GEMV streams weights once, and the hardware prefetcher alone left it at about a third of DRAM
/// bandwidth. L2 tracks more misses in flight than L1: `T0` alone at 4 to 32 blocks ahead reached
/// ~9.5 GB/s on one Zen 4 core, `T1` alone at 8 ahead ~13 GB/s.
const PREFETCH_BLOCKS: usize = 16;

/// Tile-blocks ahead whose weights are also asked into L1 (`T0`), by then mostly in L2. The loads
/// then hit L1: without it the load of every index vector waited on L2 (a quarter of the GEMV's time
/// on the instruction after it). One Zen 4 core, memory-resident `gemv_speed` (2048x6144 and
/// 4096x2048) with the settings alternated in one sitting: 15.5-19.2 GB/s with `T1` 16 + `T0` 4
/// against 12.2-15.2 with `T1` 8 alone, where the same GEMV computes at ~21.5 GB/s from cache; 2 to 8
/// blocks for `T0` and 16 to 32 for `T1` were all close (BENCHMARKS.md, session 12).
const L1_PREFETCH_BLOCKS: usize = 4;

/// Prefetches the bits and scales [`PREFETCH_BLOCKS`] tile-blocks ahead into L2 and the bits
/// [`L1_PREFETCH_BLOCKS`] ahead into L1 (possibly in the next tile).
#[inline(always)]
pub(super) unsafe fn prefetch_ahead(p: &LutPacked, t: usize, b: usize) {
    let here = t * p.kb + b;
    prefetch_l2(p, here + PREFETCH_BLOCKS);
    if let Some(bits) = tile_block_ahead(p, here + L1_PREFETCH_BLOCKS) {
        for line in 0..TILE_BLOCK_BYTES / 64 {
            _mm_prefetch::<_MM_HINT_T0>(bits.add(64 * line).cast());
        }
    }
}

/// Asks the bits and scales of tile-block `index` (counted over all tiles, `t * kb + b`) into L2
/// (`T1`), if the matrix has it.
#[inline(always)]
pub(super) unsafe fn prefetch_l2(p: &LutPacked, index: usize) {
    if let Some(bits) = tile_block_ahead(p, index) {
        for line in 0..TILE_BLOCK_BYTES / 64 {
            _mm_prefetch::<_MM_HINT_T1>(bits.add(64 * line).cast());
        }
        _mm_prefetch::<_MM_HINT_T1>(p.scales.as_ptr().add(index * TILE_ROWS).cast());
    }
}

/// The bits of tile-block `index` (counted over all tiles), if the matrix has it.
#[inline(always)]
unsafe fn tile_block_ahead(p: &LutPacked, index: usize) -> Option<*const u8> {
    let start = index * TILE_BLOCK_BYTES;
    (start + TILE_BLOCK_BYTES <= p.bits.len()).then(|| p.bits.as_ptr().add(start))
}

#[inline(always)]
unsafe fn indices(bits: *const u8, c: usize) -> (__m256i, __m256i) {
    let nibble = _mm256_set1_epi8(0x0f);
    let v = _mm256_loadu_si256(bits.add(32 * c).cast());
    (_mm256_and_si256(v, nibble), _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble))
}

/// `facc[q] = fma(isum(rows 8q..8q+8), d_w * d_a, facc[q])` for one finished block.
#[inline(always)]
pub(super) unsafe fn scale_block(acc: &[__m256i; 2], scales: *const u16, da: f32, facc: &mut [__m256; 4]) {
    let sums = [
        _mm256_castsi256_si128(acc[0]),
        _mm256_castsi256_si128(acc[1]),
        _mm256_extracti128_si256::<1>(acc[0]),
        _mm256_extracti128_si256::<1>(acc[1]),
    ];
    let vda = _mm256_set1_ps(da);
    for (q, (f, s)) in facc.iter_mut().zip(sums).enumerate() {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(scales.add(8 * q).cast()));
        let isum = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(s));
        *f = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, vda), *f);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_tile(p: &LutPacked, t: usize, tables: *const u8, scales: &[f32], out: &mut [f32]) {
    let mut facc = [_mm256_setzero_ps(); 4];
    for (b, &da) in scales.iter().enumerate() {
        let bits = p.bits.as_ptr().add((t * p.kb + b) * TILE_BLOCK_BYTES);
        prefetch_ahead(p, t, b);
        let tb = tables.add(b * 32 * TABLE_BYTES);
        let mut acc = [_mm256_setzero_si256(); 2];
        for c in 0..16 {
            let (i0, i1) = indices(bits, c);
            accumulate_chunk(i0, i1, tb, c, &mut acc);
        }
        scale_block(&acc, p.tile_block_scales(t, b).as_ptr(), da, &mut facc);
    }
    for (q, f) in facc.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * q), *f);
    }
}

/// Rows of `tiles` against one activation row's tables.
pub fn gemv_tiles(p: &LutPacked, tiles: Range<usize>, tables: &[u8], scales: &[f32], out: &mut [f32]) {
    assert!(tables.len() >= p.kb * 32 * TABLE_BYTES && scales.len() >= p.kb);
    assert!(out.len() >= tiles.len() * TILE_ROWS && tiles.end <= p.tiles);
    for (ti, t) in tiles.enumerate() {
        // SAFETY: the caller checked AVX2/FMA/F16C; all reads are within the asserted lengths.
        unsafe { gemv_tile(p, t, tables.as_ptr(), &scales[..p.kb], &mut out[ti * TILE_ROWS..][..TILE_ROWS]) };
    }
}

/// `facc` in memory: `out[8q..8q+8] = fma(isum, d_w * d_a, out[8q..8q+8])` for one finished block.
#[inline(always)]
pub(super) unsafe fn scale_block_into(acc: &[__m256i; 2], scales: *const u16, da: f32, out: *mut f32) {
    let mut facc = [_mm256_setzero_ps(); 4];
    for (q, f) in facc.iter_mut().enumerate() {
        *f = _mm256_loadu_ps(out.add(8 * q));
    }
    scale_block(acc, scales, da, &mut facc);
    for (q, f) in facc.iter().enumerate() {
        _mm256_storeu_ps(out.add(8 * q), *f);
    }
}

/// Up to `GEMM_COLS` activation rows against a range of tiles. Block-outer, tile-inner: the tables
/// of one block for these columns (4 KiB) stay in L1 while every tile of the range uses them; the
/// weight indices of a chunk are extracted once for all columns. `out[j]` must start zeroed.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_cols<const NC: usize>(
    p: &LutPacked,
    tiles: Range<usize>,
    tables: [*const u8; NC],
    scales: [&[f32]; NC],
    out: [*mut f32; NC],
) {
    #[allow(clippy::needless_range_loop)] // b indexes the bits, the tables and every column's scales
    for b in 0..p.kb {
        let ws = |t: usize| p.tile_block_scales(t, b).as_ptr();
        for (ti, t) in tiles.clone().enumerate() {
            let bits = p.bits.as_ptr().add((t * p.kb + b) * TILE_BLOCK_BYTES);
            let mut acc = [[_mm256_setzero_si256(); 2]; NC];
            for c in 0..16 {
                let (i0, i1) = indices(bits, c);
                for j in 0..NC {
                    accumulate_chunk(i0, i1, tables[j].add(b * 32 * TABLE_BYTES), c, &mut acc[j]);
                }
            }
            for j in 0..NC {
                scale_block_into(&acc[j], ws(t), scales[j][b], out[j].add(ti * TILE_ROWS));
            }
        }
    }
}

/// `out[j * rows + r]` for `n` activation rows (tables and scales stored one row after another),
/// `rows = tiles.len() * 32`.
pub fn gemm_tiles(p: &LutPacked, tiles: Range<usize>, n: usize, tables: &[u8], scales: &[f32], out: &mut [f32]) {
    let col_tables = p.kb * 32 * TABLE_BYTES;
    let rows = tiles.len() * TILE_ROWS;
    assert!(tables.len() >= n * col_tables && scales.len() >= n * p.kb && out.len() >= n * rows);
    assert!(tiles.end <= p.tiles);
    out[..n * rows].fill(0.0);
    let mut j = 0;
    while j < n {
        let nc = (n - j).min(GEMM_COLS);
        let tab = |c: usize| tables[(j + c) * col_tables..].as_ptr();
        let sc = |c: usize| &scales[(j + c) * p.kb..(j + c + 1) * p.kb];
        let o = |c: usize| out[(j + c) * rows..].as_ptr().cast_mut();
        let tl = tiles.clone();
        // SAFETY: the caller checked AVX2/FMA/F16C; reads and writes are within the asserted lengths,
        // and each column's output range is distinct.
        unsafe {
            match nc {
                4 => gemm_cols::<4>(
                    p,
                    tl,
                    [tab(0), tab(1), tab(2), tab(3)],
                    [sc(0), sc(1), sc(2), sc(3)],
                    [o(0), o(1), o(2), o(3)],
                ),
                3 => gemm_cols::<3>(p, tl, [tab(0), tab(1), tab(2)], [sc(0), sc(1), sc(2)], [o(0), o(1), o(2)]),
                2 => gemm_cols::<2>(p, tl, [tab(0), tab(1)], [sc(0), sc(1)], [o(0), o(1)]),
                _ => gemm_cols::<1>(p, tl, [tab(0)], [sc(0)], [o(0)]),
            }
        }
        j += nc;
    }
}

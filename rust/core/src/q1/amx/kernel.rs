//! A pass of up to four 16-row weight tiles against every group of 16 activation rows, block by
//! block: the tile unit holds one block of one activation group (both byte planes) while it takes
//! each weight tile of the pass against it, so each step loads two weight tiles and a quarter of the
//! activations' four. The sign bits of each GGUF block become ±1 bytes (one mask load and one blend
//! per 64 weights), the tile unit multiplies them with both byte planes of the activations (two
//! products, `isum = 256 * high + low`), and each block's integer sums are scaled into f32 exactly as
//! the LUT kernels do (`acc = fma(isum, d_w * d_a, acc)`, blocks in order), so the results are
//! bit-identical to the LUT GEMV's. The vector work of one product (the next blocks' signs, the
//! previous product's scaling) is issued around the tile unit's, not after.

use std::arch::x86_64::*;
use std::ops::Range;

use super::acts::{ActTiles, TILE_COLS};
use super::unit::{TileUnit, TILE_BYTES, TILE_STRIDE};
use crate::q1::lut::LutPacked;
use crate::q1::BlockQ1;

/// Weight rows per tile.
pub const TILE_ROWS: usize = 16;

/// A Q1 matrix as the AMX GEMM reads it: sign bits from the GGUF blocks, scales from the LUT
/// repacking (16 contiguous fp16 values per tile and block).
pub struct WeightRows<'a> {
    pub blocks: &'a [BlockQ1],
    pub packed: &'a LutPacked,
}

impl WeightRows<'_> {
    pub fn rows(&self) -> usize {
        self.packed.rows
    }

    pub fn tiles(&self) -> usize {
        self.rows().div_ceil(TILE_ROWS)
    }

    /// The fp16 scales of rows `16 * tile..16 * tile + 16` in block `b` (zero past the last row).
    fn scales(&self, tile: usize, b: usize) -> *const u16 {
        let lut_tile = self.packed.tile_block_scales(tile / 2, b);
        lut_tile[TILE_ROWS * (tile % 2)..][..TILE_ROWS].as_ptr()
    }
}

/// Weight tiles per pass: the pass walks the blocks in order and, at each block and activation
/// group, takes every tile of the pass against the activation tiles the unit holds.
pub const PASS_TILES: usize = 4;

/// Sign blocks ahead of the tile unit at which a block's signs are expanded: by the time the unit
/// loads them, the vector stores that wrote them have left the store buffer.
const AHEAD: usize = 2;
/// Expanded sign blocks kept: one block of every tile of a pass, and the ones expanded ahead.
const RING: usize = PASS_TILES + AHEAD;

/// One block of a weight tile as the tile unit reads it: two 16 x 64 tiles of ±1 bytes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct SignBlock([u8; 2 * TILE_BYTES]);

/// One block's 16 x 16 integer sums of the high byte plane, then the low one, weight rows by
/// activation rows.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct PlaneProducts([[i32; TILE_ROWS * TILE_COLS]; 2]);

/// One 16-row weight tile times one group of 16 activation rows, in f32: `[m][n]`.
pub type TileResult = [[f32; TILE_COLS]; TILE_ROWS];

/// A product waiting for its epilogue while the tile unit computes the next one.
#[derive(Clone, Copy)]
struct Pending {
    result: usize,
    group: usize,
    block: usize,
    sums: usize,
    dw: [f32; TILE_ROWS],
}

/// Tiles `tiles` (at most [`PASS_TILES`]) of `w` times every activation group:
/// `results[i * groups + g]` for the `i`-th tile and group `g`, every block scaled in order with the
/// LUT kernels' epilogue (`acc = fma(isum, d_w * d_a, acc)`), hence bit-identical to them.
///
/// # Safety
/// AVX-512 (F, BW), FMA and F16C are available, and `unit.begin()` ran on this thread.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn pass<U: TileUnit>(
    unit: &mut U,
    w: &WeightRows,
    tiles: Range<usize>,
    acts: &ActTiles,
    results: &mut Vec<TileResult>,
) {
    let (kb, nt, groups) = (w.packed.kb, tiles.len(), acts.groups);
    debug_assert!(nt <= PASS_TILES);
    results.clear();
    results.resize(nt * groups, [[0.0; TILE_COLS]; TILE_ROWS]);
    // Sign block `e` is block `e / nt` of tile `e % nt`, expanded into `ring[e % RING]`.
    let mut ring = [SignBlock([0; 2 * TILE_BYTES]); RING];
    let signs = kb * nt;
    let expand_at = |e: usize, ring: &mut [SignBlock; RING]| {
        if e < signs {
            expand(w, tiles.start + e % nt, e / nt, &mut ring[e % RING]);
        }
    };
    for e in 0..AHEAD {
        expand_at(e, &mut ring);
    }
    let mut sums = [PlaneProducts([[0; TILE_ROWS * TILE_COLS]; 2]); 2];
    let mut dws = [[0f32; TILE_ROWS]; PASS_TILES];
    let mut pending: Option<Pending> = None;
    let mut odd = false;
    for b in 0..kb {
        for g in 0..groups {
            unit.load_acts(acts.block(g, b));
            for (i, dw) in dws.iter_mut().enumerate().take(nt) {
                let e = b * nt + i;
                if g == 0 {
                    // The vector work of a sign block, once per block and tile.
                    expand_at(e + AHEAD, &mut ring);
                    prefetch_rows(w, tiles.start + i, b + PREFETCH_BLOCKS);
                    let scales = _mm256_loadu_si256(w.scales(tiles.start + i, b).cast());
                    _mm512_storeu_ps(dw.as_mut_ptr(), _mm512_cvtph_ps(scales));
                }
                let planes = &mut sums[usize::from(odd)];
                unit.product(ring[e % RING].0.as_ptr(), planes.0.as_mut_ptr().cast());
                if let Some(p) = pending {
                    scale_into(&sums[p.sums], &p.dw, acts.scales(p.group, p.block), &mut results[p.result]);
                }
                pending = Some(Pending { result: i * groups + g, group: g, block: b, sums: usize::from(odd), dw: *dw });
                odd = !odd;
            }
        }
    }
    if let Some(p) = pending {
        scale_into(&sums[p.sums], &p.dw, acts.scales(p.group, p.block), &mut results[p.result]);
    }
}

/// Writes block `b` of tile `tile` as ±1 bytes (rows past the matrix as zeros).
#[inline(always)]
unsafe fn expand(w: &WeightRows, tile: usize, b: usize, out: &mut SignBlock) {
    let kb = w.packed.kb;
    let rows = (w.rows() - tile * TILE_ROWS).min(TILE_ROWS);
    let first = w.blocks.as_ptr().add(tile * TILE_ROWS * kb + b);
    let (plus, minus) = (_mm512_set1_epi8(1), _mm512_set1_epi8(-1));
    for m in 0..TILE_ROWS {
        for half in 0..2 {
            let signs = if m < rows {
                let bits = (*first.add(m * kb)).qs.as_ptr().add(8 * half).cast::<u64>().read_unaligned();
                _mm512_mask_blend_epi8(bits, minus, plus)
            } else {
                _mm512_setzero_si512()
            };
            _mm512_store_si512(out.0.as_mut_ptr().add(half * TILE_BYTES + m * TILE_STRIDE).cast(), signs);
        }
    }
}

/// Blocks ahead at which a tile's rows are prefetched: each row of a pass is its own slow stream
/// (18 bytes per block), more streams than the hardware prefetchers follow.
const PREFETCH_BLOCKS: usize = 8;

#[inline(always)]
unsafe fn prefetch_rows(w: &WeightRows, tile: usize, b: usize) {
    let kb = w.packed.kb;
    if b >= kb {
        return;
    }
    let rows = (w.rows() - tile * TILE_ROWS).min(TILE_ROWS);
    let first = w.blocks.as_ptr().add(tile * TILE_ROWS * kb + b);
    for m in 0..rows {
        _mm_prefetch::<_MM_HINT_T0>(first.add(m * kb).cast());
    }
}

/// `acc[m] = fma(isum[m], d_w[m] * d_a, acc[m])` for one block, `isum = 256 * high + low`: the LUT
/// kernels' epilogue.
#[inline(always)]
unsafe fn scale_into(sums: &PlaneProducts, dw: &[f32; TILE_ROWS], da: &[f32; TILE_COLS], acc: &mut TileResult) {
    let da = _mm512_loadu_ps(da.as_ptr());
    let [high, low] = sums.0.each_ref().map(|p| p.as_ptr());
    for (m, row) in acc.iter_mut().enumerate() {
        let high = _mm512_load_si512(high.add(TILE_COLS * m).cast());
        let low = _mm512_load_si512(low.add(TILE_COLS * m).cast());
        let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32::<8>(high), low));
        let a = _mm512_fmadd_ps(isum, _mm512_mul_ps(_mm512_set1_ps(dw[m]), da), _mm512_loadu_ps(row.as_ptr()));
        _mm512_storeu_ps(row.as_mut_ptr(), a);
    }
}

/// `result` transposed, activation rows by weight rows: four rounds of in-register shuffles
/// (pairs of floats, of float pairs, of 128-bit lanes, of 256-bit halves).
///
/// # Safety
/// AVX-512 F is available.
#[target_feature(enable = "avx512f")]
pub unsafe fn transposed(result: &TileResult) -> TileResult {
    let mut r: [__m512; 16] = std::array::from_fn(|m| _mm512_loadu_ps(result[m].as_ptr()));
    let mut t = [_mm512_setzero_ps(); 16];
    for k in 0..8 {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for k in 0..4 {
        for j in 0..2 {
            let (a, b) = (_mm512_castps_pd(t[4 * k + j]), _mm512_castps_pd(t[4 * k + j + 2]));
            r[4 * k + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            r[4 * k + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    for k in 0..2 {
        for j in 0..4 {
            let (a, b) = (r[8 * k + j], r[8 * k + j + 4]);
            t[8 * k + j] = _mm512_shuffle_f32x4::<0x88>(a, b);
            t[8 * k + j + 4] = _mm512_shuffle_f32x4::<0xdd>(a, b);
        }
    }
    for j in 0..8 {
        let (a, b) = (t[j], t[j + 8]);
        r[j] = _mm512_shuffle_f32x4::<0x88>(a, b);
        r[j + 8] = _mm512_shuffle_f32x4::<0xdd>(a, b);
    }
    let mut out = [[0f32; TILE_COLS]; TILE_ROWS];
    for (row, v) in out.iter_mut().zip(r) {
        _mm512_storeu_ps(row.as_mut_ptr(), v);
    }
    out
}

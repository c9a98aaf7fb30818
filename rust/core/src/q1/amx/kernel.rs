//! A pass of up to four 16-row weight tiles against every group of 16 activation rows, block by
//! block: the sign bits of each GGUF block become ±1 bytes (one mask load and one blend per 64
//! weights), the tile unit multiplies them with both byte planes of the activations (two products,
//! `isum = 256 * high + low`), and each block's integer sums are scaled into f32 exactly as the LUT
//! kernels do (`acc = fma(isum, d_w * d_a, acc)`, blocks in
//! order), so the results are bit-identical to the LUT GEMV's. The vector work of one product (the
//! next blocks' signs, the previous product's scaling) is issued around the tile unit's, not after.

use std::arch::x86_64::*;
use std::ops::Range;

use super::acts::{ActTiles, Plane, TILE_COLS};
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

/// Weight tiles per pass: the pass walks the blocks in order and, at each block, takes every tile of
/// the pass against the activation tiles it holds, so those are loaded once per block and pass.
pub const PASS_TILES: usize = 4;

/// Products ahead of the tile unit at which a block's signs are expanded: by the time the unit loads
/// them, the vector stores that wrote them have left the store buffer.
const AHEAD: usize = 2;
const RING: usize = 4;

/// One block of a weight tile as the tile unit reads it: two 16 x 64 tiles of ±1 bytes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct SignBlock([u8; 2 * TILE_BYTES]);

/// One block's 16 x 16 integer sums of one byte plane, weight rows by activation rows.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Products([i32; TILE_ROWS * TILE_COLS]);

/// The products of a block's high and low byte planes.
type PlaneProducts = [Products; 2];

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
    let mut ring = [SignBlock([0; 2 * TILE_BYTES]); RING];
    let mut sums = [[Products([0; TILE_ROWS * TILE_COLS]); 2]; 2];
    // Step `s` is block `s / nt` of tile `s % nt`.
    let steps = kb * nt;
    let expand_step = |s: usize, ring: &mut [SignBlock; RING]| {
        expand(w, tiles.start + s % nt, s / nt, &mut ring[s % RING]);
    };
    for s in 0..AHEAD.min(steps) {
        expand_step(s, &mut ring);
    }
    let mut pending: Option<Pending> = None;
    let mut odd = false;
    for s in 0..steps {
        let (b, i) = (s / nt, s % nt);
        if s + AHEAD < steps {
            expand_step(s + AHEAD, &mut ring);
        }
        prefetch_rows(w, tiles.start + i, b + PREFETCH_BLOCKS);
        let mut dw = [0f32; TILE_ROWS];
        _mm512_storeu_ps(dw.as_mut_ptr(), _mm512_cvtph_ps(_mm256_loadu_si256(w.scales(tiles.start + i, b).cast())));
        for g in 0..groups {
            // The two planes' products alternate the unit's tile sets, as consecutive products should.
            let (a, planes) = (ring[s % RING].0.as_ptr(), &mut sums[usize::from(odd)]);
            unit.load_acts(acts.block(g, b, Plane::High));
            unit.product::<false>(a, planes[Plane::High as usize].0.as_mut_ptr());
            unit.load_acts(acts.block(g, b, Plane::Low));
            unit.product::<true>(a, planes[Plane::Low as usize].0.as_mut_ptr());
            if let Some(p) = pending {
                scale_into(&sums[p.sums], &p.dw, acts.scales(p.group, p.block), &mut results[p.result]);
            }
            pending = Some(Pending { result: i * groups + g, group: g, block: b, sums: usize::from(odd), dw });
            odd = !odd;
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
    let [high, low] = sums.each_ref().map(|p| p.0.as_ptr());
    for (m, row) in acc.iter_mut().enumerate() {
        let high = _mm512_load_si512(high.add(TILE_COLS * m).cast());
        let low = _mm512_load_si512(low.add(TILE_COLS * m).cast());
        let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32::<8>(high), low));
        let a = _mm512_fmadd_ps(isum, _mm512_mul_ps(_mm512_set1_ps(dw[m]), da), _mm512_loadu_ps(row.as_ptr()));
        _mm512_storeu_ps(row.as_mut_ptr(), a);
    }
}

//! AVX-512 VNNI small GEMM over the LUT layout: no tables, one `vpdpbusd` per 64 weight-activation
//! products, each decoded weight vector shared by up to [`PASS_ROWS`] activation rows.
//!
//! For one half tile (16 weight rows), byte column `c` of the packed layout holds the bytes `qs[c]` of
//! the 16 rows. Broadcast to the four 128-bit lanes and spread with `vpshufb` so that byte `4r + i`
//! holds row `r`'s byte, a `vptestmb` against `1 << i` (low nibble: weights `8c + i`) or `16 << i`
//! (high nibble: weights `8c + 4 + i`) gives a 64-bit mask, and `vmovdqu8 {z}` turns it into u8 weights
//! `w ∈ {0, 2}`: 32-bit lane `r` holds 4 consecutive weights of row `r`. The int16 activations come as
//! two signed byte planes, `q = 256 * high + low` (`act::byte_planes`); `vpdpbusd` against the
//! broadcast 4 bytes of one plane adds `2 * (sum of that plane's values whose bit is set)` to lane `r`.
//! With one accumulator per plane, the low one starting at `-S_all` (the activation block's sum), a
//! block ends with exactly `isum = 256 * high_acc + low_acc = 2 * S_set - S_all = sum_i s_i * q_i`,
//! which is scaled as `acc = fma(isum, d_w * d_a, acc)` in block order, like every other kernel, so
//! the results agree bit for bit.
//!
//! Bounds: each plane's accumulator stays within `3 * 128 * 128` (far inside i32); `vpdpbusd` adds
//! four u8 x i8 products without saturation; `isum` is at most the block's L1 norm, exact as f32.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::act::{byte_planes, QuantizedActs};
use super::super::block::BLOCK_WEIGHTS;
use super::avx2::prefetch_ahead;
use super::{balanced_runs, LutPacked, TILE_ROWS};

/// Most activation rows one pass over a tile keeps in accumulators (two zmm each per half tile, one
/// per byte plane).
pub const PASS_ROWS: usize = 8;

/// Weight rows one accumulator covers (16 lanes of 32 bits).
const HALF_ROWS: usize = TILE_ROWS / 2;

/// A column chunk's activations rearranged block-major, so that a pass reads one 128-block of all its
/// rows from one base pointer: the byte planes `high[(b * n + j) * 128 + i]` and `low[..]`,
/// `neg_sum[b * n + j] = -S_all`, `scale[b * n + j]`.
pub struct BlockMajorActs {
    n: usize,
    high: Vec<i8>,
    low: Vec<i8>,
    neg_sum: Vec<i32>,
    scale: Vec<f32>,
}

impl BlockMajorActs {
    /// The activation rows `cols` of `acts`.
    pub fn new(acts: &QuantizedActs, cols: Range<usize>) -> BlockMajorActs {
        let (n, kb) = (cols.len(), acts.blocks_per_row());
        let planes = || vec![0; n * acts.k];
        let (neg_sum, scale) = (vec![0; n * kb], vec![0.0; n * kb]);
        let mut out = BlockMajorActs { n, high: planes(), low: planes(), neg_sum, scale };
        for (j, col) in cols.enumerate() {
            for (b, block) in acts.row(col).chunks_exact(BLOCK_WEIGHTS).enumerate() {
                let at = b * n + j;
                let high = out.high[at * BLOCK_WEIGHTS..][..BLOCK_WEIGHTS].iter_mut();
                let low = out.low[at * BLOCK_WEIGHTS..][..BLOCK_WEIGHTS].iter_mut();
                for ((h, l), &q) in high.zip(low).zip(block) {
                    (*h, *l) = byte_planes(q);
                }
                out.neg_sum[at] = -acts.sum[col * kb + b];
                out.scale[at] = acts.scale[col * kb + b];
            }
        }
        out
    }

    /// Blocks per row.
    fn kb(&self) -> usize {
        self.scale.len() / self.n
    }
}

/// Constants of the weight decoding (see the module doc).
struct Decoder {
    spread: __m512i,
    low: __m512i,
    high: __m512i,
    twos: __m512i,
}

impl Decoder {
    #[inline(always)]
    unsafe fn new() -> Decoder {
        let mut spread = [0u8; 64];
        let mut low = [0u8; 64];
        let mut high = [0u8; 64];
        for p in 0..64 {
            // Byte p = 4r + i of the vector: row r = p / 4, whose byte sits at r % 16 of every lane.
            spread[p] = (p / 4 % 16) as u8;
            low[p] = 1 << (p % 4);
            high[p] = 16 << (p % 4);
        }
        Decoder {
            spread: _mm512_loadu_si512(spread.as_ptr().cast()),
            low: _mm512_loadu_si512(low.as_ptr().cast()),
            high: _mm512_loadu_si512(high.as_ptr().cast()),
            twos: _mm512_set1_epi8(2),
        }
    }

    /// The u8 weights (0 or 2) of 16 rows for groups `2c` and `2c + 1`, from those rows' bytes `qs[c]`.
    #[inline(always)]
    unsafe fn decode(&self, bytes: *const u8) -> (__m512i, __m512i) {
        let rows = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(bytes.cast())), self.spread);
        (
            _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(rows, self.low), self.twos),
            _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(rows, self.high), self.twos),
        )
    }
}

/// 4 bytes of one activation plane broadcast to every 32-bit lane.
#[inline(always)]
unsafe fn broadcast4(a: *const i8) -> __m512i {
    _mm512_set1_epi32(a.cast::<i32>().read_unaligned())
}

/// Exact block sums of 16 weight rows (`bits` = their 16 bytes of column 0, columns 32 bytes apart)
/// against `NA` activation rows whose block's byte planes start at `planes` (rows 128 bytes apart).
#[inline(always)]
unsafe fn half_block_sums<const NA: usize>(
    dec: &Decoder,
    bits: *const u8,
    planes: [*const i8; 2],
    neg_sum: *const i32,
) -> [__m512i; NA] {
    let mut high = [_mm512_setzero_si512(); NA];
    let mut low = [_mm512_setzero_si512(); NA];
    for (j, a) in low.iter_mut().enumerate() {
        *a = _mm512_set1_epi32(*neg_sum.add(j));
    }
    for c in 0..16 {
        let (w0, w1) = dec.decode(bits.add(32 * c));
        for (acc, plane) in [&mut high, &mut low].into_iter().zip(planes) {
            for (j, a) in acc.iter_mut().enumerate() {
                let x = plane.add(j * BLOCK_WEIGHTS + 8 * c);
                *a = _mm512_dpbusd_epi32(*a, w0, broadcast4(x));
                *a = _mm512_dpbusd_epi32(*a, w1, broadcast4(x.add(4)));
            }
        }
    }
    std::array::from_fn(|j| _mm512_add_epi32(_mm512_slli_epi32::<8>(high[j]), low[j]))
}

/// Tile `t` against activation rows `j0..j0 + NA` of `acts` into `out[j * stride + r]`: from 0, for every
/// block in order, `acc = fma(isum, d_w * d_a, acc)`. The sums build up in a local buffer: the rows of
/// `out` are often a multiple of 4 KiB apart, and updating them block by block thrashed L1 sets.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_pass<const NA: usize>(
    p: &LutPacked,
    t: usize,
    acts: &BlockMajorActs,
    j0: usize,
    out: *mut f32,
    stride: usize,
) {
    let dec = Decoder::new();
    let mut acc = [[0f32; TILE_ROWS]; NA];
    for b in 0..p.kb {
        let bits = p.tile_block_bits(t, b).as_ptr();
        let scales = p.tile_block_scales(t, b).as_ptr();
        prefetch_ahead(p, t, b);
        let at = b * acts.n + j0;
        let planes = [acts.high.as_ptr().add(at * BLOCK_WEIGHTS), acts.low.as_ptr().add(at * BLOCK_WEIGHTS)];
        let (neg_sum, da) = (acts.neg_sum.as_ptr().add(at), acts.scale.as_ptr().add(at));
        for h in 0..2 {
            let isum = half_block_sums::<NA>(&dec, bits.add(HALF_ROWS * h), planes, neg_sum);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(HALF_ROWS * h).cast()));
            for (j, (s, a)) in isum.iter().zip(&mut acc).enumerate() {
                let a = a[HALF_ROWS * h..].as_mut_ptr();
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*da.add(j)));
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(*s), scale, _mm512_loadu_ps(a)));
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        std::ptr::copy_nonoverlapping(a.as_ptr(), out.add(j * stride), TILE_ROWS);
    }
}

/// `out[j * rows + r]` for the `acts.n` activation rows against `tiles` (`rows = tiles.len() * 32`).
pub fn gemm_tiles(p: &LutPacked, tiles: Range<usize>, acts: &BlockMajorActs, out: &mut [f32]) {
    let rows = tiles.len() * TILE_ROWS;
    assert!(tiles.end <= p.tiles && acts.kb() == p.kb && out.len() >= acts.n * rows);
    for (ti, t) in tiles.enumerate() {
        for pass in balanced_runs(acts.n, PASS_ROWS) {
            let o = out[pass.start * rows + ti * TILE_ROWS..].as_mut_ptr();
            // SAFETY: the caller checked AVX-512 F/BW/VL/VNNI and AVX2/FMA/F16C (`Isa::has_avx512_vnni`);
            // the pass reads rows `pass` of `acts` and blocks of tile `t` (asserted in range), and writes
            // `out[(pass.start + j) * rows + ti * 32..][..32]` for `j < pass.len()`, inside `out`.
            unsafe { tile_pass_dyn(pass.len(), p, t, acts, pass.start, o, rows) };
        }
    }
}

/// [`tile_pass`] for a run-time row count `na` in `1..=PASS_ROWS`.
///
/// # Safety
/// As for [`tile_pass`]: the CPU has the features it enables, and `out` has room for `na` rows.
unsafe fn tile_pass_dyn(na: usize, p: &LutPacked, t: usize, a: &BlockMajorActs, j0: usize, o: *mut f32, s: usize) {
    match na {
        1 => tile_pass::<1>(p, t, a, j0, o, s),
        2 => tile_pass::<2>(p, t, a, j0, o, s),
        3 => tile_pass::<3>(p, t, a, j0, o, s),
        4 => tile_pass::<4>(p, t, a, j0, o, s),
        5 => tile_pass::<5>(p, t, a, j0, o, s),
        6 => tile_pass::<6>(p, t, a, j0, o, s),
        7 => tile_pass::<7>(p, t, a, j0, o, s),
        8 => tile_pass::<8>(p, t, a, j0, o, s),
        _ => unreachable!("a pass holds 1..={PASS_ROWS} rows, got {na}"),
    }
}

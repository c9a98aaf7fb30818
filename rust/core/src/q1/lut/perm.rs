//! AVX-512 small GEMM by 6-bit table lookup: one `vpermt2w` looks up 6 weights of 32 rows at once
//! (192 weight-activation products, 3x a `vpdpbusd`). This module owns the kernel, its tables
//! ([`PermTables`]) and the index extraction; it reads the [`LutPacked`] bits as they are (no weight
//! copy).
//!
//! A 128-block splits into [`GROUPS`] = 22 groups: 21 of 6 weights (`6k..6k+5`) and one of 2 (126,
//! 127; its 4 missing activations count as 0). Group `k`'s table, per activation row and block, is the
//! 64 int16 entries `T_k[b] = sum_{j<6} (bit j of b ? +a_{6k+j} : -a_{6k+j})`, whose magnitude is at
//! most the block's L1 norm (`act::L1_MAX`), held as two zmm (entries 0..31, 32..63). The index of a weight row is its 6 sign bits of the group:
//! with `W_c = qs[c] | qs[c+1] << 8` (one 16-bit lane per row), group `k`'s index vector is
//! `W_{6k/8} >> (6k % 8)`; `vpermt2w` reads only bits 5..0 of each lane, so nothing is masked.
//!
//! Bounds: a block's int16 accumulator adds 22 table entries, each the signed sum of its group's
//! activations, so it always equals the partial exact sum `sum_i s_i q_i` over the groups added so
//! far, whose magnitude is at most the block's L1 norm, `<= act::L1_MAX < 32767`: no int16 overflow
//! at any step. (The table build itself wraps on the way; its entries are still exact, being their
//! true values modulo 2^16 and within int16.) Each block's exact sum is widened to i32, converted to f32 and scaled as
//! `acc = fma(isum, d_w * d_a, acc)` in block order from 0, the same operations in the same order as
//! every other kernel, so the results agree bit for bit.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::act::QuantizedActs;
use super::super::block::BLOCK_WEIGHTS;
use super::avx2::prefetch_l2;
use super::{balanced_runs, LutPacked, TILE_ROWS};
use crate::q1::par::SharedOut;

/// Table groups per 128-block: 21 of 6 weights and one of 2 (an even count: the kernel takes pairs).
pub const GROUPS: usize = 22;

/// Most weight tiles one pass holds index vectors for.
const PASS_TILES: usize = 4;
/// Most activation rows one pass holds accumulators for.
const PASS_ROWS: usize = 4;
/// Most tiles whose accumulators live through one sweep of the blocks (512 weight rows).
const SWEEP_TILES: usize = 16;
/// Bytes of tables one sweep step keeps in use: the step's blocks of every activation row, held in L2
/// (1-2 MiB per core) while the sweep's tiles take their turns, instead of streamed from L3 once per
/// 4 tiles.
const STEP_TABLE_BYTES: usize = 384 << 10;

/// 64 bytes, aligned for zmm loads: half of one group's table (32 int16 entries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct Half(pub [i16; 32]);

/// The lookup tables of some activation rows: row `j`, block `b`, group `k`'s entries `0..32` at
/// `halves[((j * kb + b) * GROUPS + k) * 2]` and `32..64` right after; `scale[j * kb + b]` the
/// activation scales.
pub struct PermTables<'a> {
    pub n: usize,
    pub kb: usize,
    pub halves: &'a [Half],
    pub scale: &'a [f32],
}

impl<'a> PermTables<'a> {
    /// Builds the tables of activation rows `cols` of `acts` on this thread into `buf` (grown as
    /// needed, never shrunk) and returns how many halves they take. The caller checked AVX-512 F/BW
    /// (`Isa::has_avx512`).
    pub fn fill(acts: &QuantizedActs, cols: Range<usize>, buf: &mut Vec<Half>) -> usize {
        let per_row = acts.blocks_per_row() * GROUPS * 2;
        let len = cols.len() * per_row;
        if buf.len() < len {
            buf.resize(len, Half([0; 32]));
        }
        for (j, row) in cols.zip(buf[..len].chunks_exact_mut(per_row)) {
            for (block, out) in acts.row(j).chunks_exact(BLOCK_WEIGHTS).zip(row.chunks_exact_mut(GROUPS * 2)) {
                // SAFETY: the caller checked AVX-512 F/BW; `block` holds 128 values, `out` 44 halves.
                unsafe { build_block(block, out) };
            }
        }
        len
    }

    /// Tables already built (by [`PermTables::fill`]) for rows `cols` of `acts`.
    pub fn view(acts: &'a QuantizedActs, cols: Range<usize>, halves: &'a [Half]) -> Self {
        let kb = acts.blocks_per_row();
        debug_assert_eq!(halves.len(), cols.len() * kb * GROUPS * 2);
        PermTables { n: cols.len(), kb, halves, scale: &acts.scale[cols.start * kb..cols.end * kb] }
    }
}

/// Lane masks of the sign bits: lane `b` of a table half has bit `j` of `b` set.
const BIT_LANES: [u32; 5] = [0xaaaa_aaaa, 0xcccc_cccc, 0xf0f0_f0f0, 0xff00_ff00, 0xffff_0000];

/// The 22 tables (44 halves) of one 128-block of activations (int16 arithmetic wraps here; the
/// entries come out exact, see the module doc).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn build_block(block: &[i16], out: &mut [Half]) {
    assert!(block.len() == BLOCK_WEIGHTS && out.len() == GROUPS * 2);
    let mut a = [0i16; GROUPS * 6];
    a[..BLOCK_WEIGHTS].copy_from_slice(block);
    for (g, pair) in a.chunks_exact(6).zip(out.chunks_exact_mut(2)) {
        // Lane b of the low half: sum of +-a_j (j < 5) by the bits of b, and -a_5.
        let mut low = _mm512_set1_epi16(g.iter().fold(0i16, |s, &v| s.wrapping_sub(v)));
        for (j, &mask) in BIT_LANES.iter().enumerate() {
            low = _mm512_mask_add_epi16(low, mask, low, _mm512_set1_epi16(g[j].wrapping_mul(2)));
        }
        let high = _mm512_add_epi16(low, _mm512_set1_epi16(g[5].wrapping_mul(2)));
        // SAFETY: `Half` is 64 bytes, 64-byte aligned.
        _mm512_store_si512(pair[0].0.as_mut_ptr().cast(), low);
        _mm512_store_si512(pair[1].0.as_mut_ptr().cast(), high);
    }
}

/// The 22 index vectors of one tile-block (`bits`: its 512 bytes, byte `32c + r` = `qs[c]` of row
/// `r`): lane `r` of vector `k` holds row `r`'s signs of weights `6k..6k+6` in bits 5..0.
#[inline(always)]
unsafe fn tile_block_indices(bits: *const u8, out: &mut [__m512i; GROUPS]) {
    let z = |c: usize| widen_column(bits, c);
    let w = |low: __m512i, high: __m512i| or_shifted(low, high);
    // Every 4 groups take 3 bytes: offsets 0, 6, 12 and 18 bits into byte 3q.
    for q in 0..5 {
        let (z0, z1, z2) = (z(3 * q), z(3 * q + 1), z(3 * q + 2));
        out[4 * q] = z0;
        out[4 * q + 1] = _mm512_srli_epi16::<6>(w(z0, z1));
        out[4 * q + 2] = _mm512_srli_epi16::<4>(w(z1, z2));
        out[4 * q + 3] = _mm512_srli_epi16::<2>(z2);
    }
    // Groups 20 (weights 120..125) and 21 (126, 127; bits 2..5 zero as the high byte is zero).
    let z15 = z(15);
    out[20] = z15;
    out[21] = _mm512_srli_epi16::<6>(z15);
}

/// Byte column `c` of a tile-block (`qs[c]` of its 32 rows), one 16-bit lane per row.
#[inline(always)]
unsafe fn widen_column(bits: *const u8, c: usize) -> __m512i {
    _mm512_cvtepu8_epi16(_mm256_loadu_si256(bits.add(32 * c).cast()))
}

/// `low | high << 8` per 16-bit lane.
#[inline(always)]
unsafe fn or_shifted(low: __m512i, high: __m512i) -> __m512i {
    _mm512_or_si512(low, _mm512_slli_epi16::<8>(high))
}

/// Exact block sums (int16, lane = weight row) of `J` activation rows, whose tables of this block start
/// at `tab` (rows `stride` halves apart), against `T` tiles (`idx[t]`): `sums[j][t]`.
#[inline(always)]
unsafe fn block_sums<const T: usize, const J: usize>(
    idx: &[[__m512i; GROUPS]; T],
    tab: *const Half,
    stride: usize,
) -> [[__m512i; T]; J] {
    let mut acc = [[_mm512_setzero_si512(); T]; J];
    // Groups in pairs, each pair summed before it meets the accumulator: the shorter dependency
    // chains sustain ~15% more lookups per cycle on Zen 4 than one add per lookup into it.
    for k in (0..GROUPS).step_by(2) {
        for (j, row) in acc.iter_mut().enumerate() {
            let pair = tab.add(j * stride + 2 * k);
            let (low0, high0) = (_mm512_load_si512(pair.cast()), _mm512_load_si512(pair.add(1).cast()));
            let (low1, high1) = (_mm512_load_si512(pair.add(2).cast()), _mm512_load_si512(pair.add(3).cast()));
            for (a, tile) in row.iter_mut().zip(idx) {
                let p0 = _mm512_permutex2var_epi16(low0, tile[k], high0);
                let p1 = _mm512_permutex2var_epi16(low1, tile[k + 1], high1);
                *a = _mm512_add_epi16(*a, _mm512_add_epi16(p0, p1));
            }
        }
    }
    acc
}

/// One block `b` of `T` tiles, met by the activation rows of `tables`: each tile's index vectors
/// (`idx[t]`) and its 32 weight scales as two f32 vectors (`dw[t]`).
struct TileBlock<'a, 't, const T: usize> {
    idx: &'a [[__m512i; GROUPS]; T],
    dw: &'a [[__m512; 2]; T],
    tables: &'a PermTables<'t>,
    b: usize,
}

impl<const T: usize> TileBlock<'_, '_, T> {
    /// Activation rows `j0..j0 + J`: `facc[(t * n + j) * 32 + r] = fma(isum, d_w * d_a, facc[..])`.
    #[inline(always)]
    unsafe fn pass<const J: usize>(&self, j0: usize, facc: *mut f32) {
        let (tables, b) = (self.tables, self.b);
        let stride = tables.kb * GROUPS * 2;
        let sums = block_sums::<T, J>(self.idx, tables.halves.as_ptr().add(j0 * stride + b * GROUPS * 2), stride);
        for (j, row) in sums.iter().enumerate() {
            for (t, s) in row.iter().enumerate() {
                let da = _mm512_set1_ps(*tables.scale.get_unchecked((j0 + j) * tables.kb + b));
                let f = facc.add((t * tables.n + j0 + j) * TILE_ROWS);
                let halves = [_mm512_castsi512_si256(*s), _mm512_extracti64x4_epi64::<1>(*s)];
                for (h, s16) in halves.into_iter().enumerate() {
                    let isum = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(s16));
                    let scale = _mm512_mul_ps(self.dw[t][h], da);
                    let f = f.add(16 * h);
                    _mm512_storeu_ps(f, _mm512_fmadd_ps(isum, scale, _mm512_loadu_ps(f)));
                }
            }
        }
    }

    /// [`pass`](Self::pass) for the run-time row range `rows` (`1..=PASS_ROWS` rows).
    #[inline(always)]
    unsafe fn pass_rows(&self, rows: Range<usize>, facc: *mut f32) {
        match rows.len() {
            1 => self.pass::<1>(rows.start, facc),
            2 => self.pass::<2>(rows.start, facc),
            3 => self.pass::<3>(rows.start, facc),
            PASS_ROWS => self.pass::<PASS_ROWS>(rows.start, facc),
            n => unreachable!("a pass holds 1..={PASS_ROWS} rows, got {n}"),
        }
    }
}

/// Blocks `blocks` of tiles `t0..t0 + T` against every row of `tables`, added into `facc` (`T * n * 32`
/// values).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile_group<const T: usize>(
    p: &LutPacked,
    t0: usize,
    blocks: Range<usize>,
    tables: &PermTables,
    facc: &mut [f32],
) {
    assert!(t0 + T <= p.tiles && tables.kb == p.kb && blocks.end <= p.kb);
    assert!(facc.len() >= T * tables.n * TILE_ROWS);
    let mut idx = [[_mm512_setzero_si512(); GROUPS]; T];
    let mut dw = [[_mm512_setzero_ps(); 2]; T];
    for b in blocks.clone() {
        for t in 0..T {
            prefetch_next(p, t0 + t, T, b + PREFETCH_BLOCKS, &blocks);
            tile_block_indices(p.tile_block_bits(t0 + t, b).as_ptr(), &mut idx[t]);
            let scales = p.tile_block_scales(t0 + t, b).as_ptr();
            dw[t] = [
                _mm512_cvtph_ps(_mm256_loadu_si256(scales.cast())),
                _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(16).cast())),
            ];
        }
        let block = TileBlock { idx: &idx, dw: &dw, tables, b };
        for rows in balanced_runs(tables.n, PASS_ROWS) {
            block.pass_rows(rows, facc.as_mut_ptr());
        }
    }
}

/// Blocks ahead of the one being multiplied whose weights (bits and scales) a tile group asks into L2.
/// The group reads its tiles' blocks in order, so this is where it will read next; the GEMV's
/// distance, counted in its tile-after-tile order, pointed at tiles the group was reading already.
/// Memory-resident `gemm_speed` (6144x2048, 2 threads, `MIB=128`), µs at n = 2/4/8/16: 90.5/136.8/
/// 230.9/412.8 with the old distance against 69.8/106.0/186.0/367.8 at 4 blocks, where the same
/// matrix read from cache takes 65.8/107.6/212.8/366.9; 2 and 8 blocks were close to 4, and n = 64
/// was unchanged (BENCHMARKS.md, session 13).
const PREFETCH_BLOCKS: usize = 4;

/// Prefetches into L2 the tile-block a group of `group` tiles (over `blocks`) will read next at
/// block `b` of tile `t`: there while `b` is in `blocks`, else in the next group's tile `t + group`,
/// as far into `blocks`.
#[inline(always)]
unsafe fn prefetch_next(p: &LutPacked, t: usize, group: usize, b: usize, blocks: &Range<usize>) {
    let (t, b) = if b < blocks.end { (t, b) } else { (t + group, blocks.start + (b - blocks.end)) };
    if b < blocks.end {
        prefetch_l2(p, t * p.kb + b);
    }
}

/// Writes row `r` of the matrix times activation row `j` of `tables` to `out[j * p.rows + r]`, for
/// the rows of `tiles` (the last tile's padding rows are dropped).
///
/// Tiles go in sweeps of [`SWEEP_TILES`]; a sweep walks the blocks in steps whose tables fit
/// [`STEP_TABLE_BYTES`], and within a step every 4-tile group of the sweep takes the step's blocks.
/// Each block still meets the accumulators in order 0, 1, 2, ..., so the sums are those of a plain
/// block loop.
///
/// # Safety
/// No other task writes the rows of `tiles` in `out` meanwhile.
pub unsafe fn gemm_tiles(p: &LutPacked, tiles: Range<usize>, tables: &PermTables, out: &SharedOut) {
    let n = tables.n;
    assert!(tiles.end <= p.tiles && tables.kb == p.kb);
    let step_blocks = (STEP_TABLE_BYTES / (n * GROUPS * 2 * size_of::<Half>())).clamp(1, p.kb.max(1));
    let mut facc = vec![0f32; SWEEP_TILES * n * TILE_ROWS];
    for sweep in (tiles.start..tiles.end).step_by(SWEEP_TILES) {
        let sweep = sweep..(sweep + SWEEP_TILES).min(tiles.end);
        facc.fill(0.0);
        for first in (0..p.kb).step_by(step_blocks) {
            let blocks = first..(first + step_blocks).min(p.kb);
            for t0 in sweep.clone().step_by(PASS_TILES) {
                let count = (sweep.end - t0).min(PASS_TILES);
                let facc = &mut facc[(t0 - sweep.start) * n * TILE_ROWS..];
                let blocks = blocks.clone();
                // SAFETY: the caller checked AVX-512 F/BW/VL and AVX2/FMA/F16C (`Isa::has_avx512`); the
                // tiles `t0..t0 + count` and `blocks` are in range and `facc` holds `count * n * 32`
                // values (asserted inside).
                unsafe {
                    match count {
                        1 => tile_group::<1>(p, t0, blocks, tables, facc),
                        2 => tile_group::<2>(p, t0, blocks, tables, facc),
                        3 => tile_group::<3>(p, t0, blocks, tables, facc),
                        _ => tile_group::<PASS_TILES>(p, t0, blocks, tables, facc),
                    }
                }
            }
        }
        for t in 0..sweep.len() {
            let row0 = (sweep.start + t) * TILE_ROWS;
            let valid = (p.rows - row0).min(TILE_ROWS);
            for j in 0..n {
                // SAFETY: these rows belong to `tiles`, which no other task writes (caller's contract).
                out.write(j * p.rows + row0, &facc[(t * n + j) * TILE_ROWS..][..valid]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q1::test_support::{avx512, fresh_rng};

    /// A fresh pseudo-random byte stream (seed printed).
    fn bytes(len: usize, what: &str) -> Vec<u8> {
        let mut rng = fresh_rng(what);
        (0..len).map(|_| rng.next_u64() as u8).collect()
    }

    #[test]
    fn tables_hold_every_signed_sum_of_their_six_activations() {
        if !avx512() {
            return;
        }
        let raw = bytes(2 * BLOCK_WEIGHTS, "tables");
        // Random values within +-90 and one massive one: sum |a| <= 31430, within the L1 bound, while
        // the build's doubled values (2 * 20000) wrap around int16 on the way.
        let mut block: Vec<i16> =
            raw.chunks_exact(2).map(|b| (u16::from_le_bytes([b[0], b[1]]) % 181) as i16 - 90).collect();
        block[..6].copy_from_slice(&[20000, -90, 90, 90, -90, -90]);
        block[126..].copy_from_slice(&[-90, 90]);
        let mut out = vec![Half([0; 32]); GROUPS * 2];
        // SAFETY: AVX-512 F/BW checked above.
        unsafe { build_block(&block, &mut out) };
        for k in 0..GROUPS {
            for b in 0..64 {
                let want: i32 = (0..6)
                    .map(|j| {
                        let a = block.get(6 * k + j).map_or(0, |&a| i32::from(a));
                        if b >> j & 1 == 1 {
                            a
                        } else {
                            -a
                        }
                    })
                    .sum();
                assert_eq!(i32::from(out[2 * k + b / 32].0[b % 32]), want, "group {k} entry {b}");
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn indices_of(bits: &[u8]) -> [[u16; 32]; GROUPS] {
        assert_eq!(bits.len(), TILE_ROWS * 16);
        let mut idx = [_mm512_setzero_si512(); GROUPS];
        tile_block_indices(bits.as_ptr(), &mut idx);
        idx.map(|v| std::mem::transmute::<__m512i, [u16; 32]>(v))
    }

    #[test]
    fn index_lanes_hold_each_rows_six_sign_bits_of_every_group() {
        if !avx512() {
            return;
        }
        let bits = bytes(TILE_ROWS * 16, "indices");
        // SAFETY: AVX-512 F/BW checked above; `bits` is one tile-block.
        let idx = unsafe { indices_of(&bits) };
        for (k, lanes) in idx.iter().enumerate() {
            for (r, &lane) in lanes.iter().enumerate() {
                // Weight i of row r: bit i % 8 of qs[i / 8], at byte 32 * (i / 8) + r (0 past the block).
                let bit =
                    |i: usize| if i < BLOCK_WEIGHTS { u16::from(bits[32 * (i / 8) + r] >> (i % 8) & 1) } else { 0 };
                let want: u16 = (0..6).map(|j| bit(6 * k + j) << j).sum();
                assert_eq!(lane & 63, want, "group {k} row {r}");
            }
        }
    }
}

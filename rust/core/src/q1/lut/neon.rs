//! NEON LUT kernels, the aarch64 twin of `avx2.rs`. One 32-byte chunk of a tile-block holds the
//! table indices of 32 rows for two weight groups (low nibble: group `2c`, high nibble: `2c + 1`);
//! `vqtbl1q_u8` looks up the low and the high bytes of 16 rows' entries at a time, `vzip1q_u8` /
//! `vzip2q_u8` interleave them back into int16, and the sums stay exact in int16 within a 128-block.
//! Accumulators hold rows in order: `acc[q]` is rows `8q..8q + 8`.
//!
//! Each block is scaled as `acc = fma(isum, d_w * d_a, acc)` with `vfmaq_f32` (fused, like the
//! scalar `f32::mul_add`), and the fp16 row scales are widened with exact integer operations, so
//! the results are bit-identical to the scalar kernel.

use std::arch::aarch64::*;
use std::ops::Range;

use super::{LutPacked, TABLE_BYTES, TILE_BLOCK_BYTES, TILE_ROWS};

/// Columns whose tables share one extraction of weight indices in the GEMM.
const GEMM_COLS: usize = 4;

/// The indices of rows 0..16 and 16..32 for groups `2c` (`.0`) and `2c + 1` (`.1`).
type Indices = ([uint8x16_t; 2], [uint8x16_t; 2]);

#[inline(always)]
unsafe fn indices(bits: *const u8, c: usize) -> Indices {
    let nibble = vdupq_n_u8(0x0f);
    let v = [vld1q_u8(bits.add(32 * c)), vld1q_u8(bits.add(32 * c + 16))];
    ([vandq_u8(v[0], nibble), vandq_u8(v[1], nibble)], [vshrq_n_u8::<4>(v[0]), vshrq_n_u8::<4>(v[1])])
}

/// The int16 entries of one group's table selected by 16 indices: rows 0..8 and 8..16 of them.
#[inline(always)]
unsafe fn lookup(lo: uint8x16_t, hi: uint8x16_t, idx: uint8x16_t) -> (int16x8_t, int16x8_t) {
    let (l, h) = (vqtbl1q_u8(lo, idx), vqtbl1q_u8(hi, idx));
    (vreinterpretq_s16_u8(vzip1q_u8(l, h)), vreinterpretq_s16_u8(vzip2q_u8(l, h)))
}

/// Adds the entries of groups `2c` and `2c + 1` selected by `idx` (32 rows) to the accumulators.
#[inline(always)]
unsafe fn accumulate_chunk(idx: &Indices, tables: *const u8, c: usize, acc: &mut [int16x8_t; 4]) {
    let t0 = tables.add(2 * c * TABLE_BYTES);
    let t1 = t0.add(TABLE_BYTES);
    let (t0lo, t0hi) = (vld1q_u8(t0), vld1q_u8(t0.add(16)));
    let (t1lo, t1hi) = (vld1q_u8(t1), vld1q_u8(t1.add(16)));
    for half in 0..2 {
        let (a0, a1) = lookup(t0lo, t0hi, idx.0[half]);
        let (b0, b1) = lookup(t1lo, t1hi, idx.1[half]);
        acc[2 * half] = vaddq_s16(acc[2 * half], vaddq_s16(a0, b0));
        acc[2 * half + 1] = vaddq_s16(acc[2 * half + 1], vaddq_s16(a1, b1));
    }
}

/// Eight fp16 values as f32, equal to `half::f16::to_f32`: the magnitude bits move to their f32
/// place and are multiplied by 2^112, which rebiases the exponent exactly for normals and
/// subnormals; infinities and NaNs get an all-ones exponent instead. (A signaling NaN stays
/// signaling here where `half` quiets it, but the `d_w * d_a` product that follows quiets it with
/// the same payload, so the products agree bit for bit.)
#[inline(always)]
unsafe fn fp16_to_f32(h: uint16x8_t) -> [float32x4_t; 2] {
    let mag = vandq_u16(h, vdupq_n_u16(0x7fff));
    let sign = vandq_u16(h, vdupq_n_u16(0x8000));
    let widen = |m: uint32x4_t, s: uint32x4_t| {
        let finite = vmulq_f32(vreinterpretq_f32_u32(m), vdupq_n_f32(f32::from_bits((127 + 112) << 23)));
        let special = vorrq_u32(m, vdupq_n_u32(0x7f80_0000));
        let bits = vbslq_u32(vcgeq_u32(m, vdupq_n_u32(0x7c00 << 13)), special, vreinterpretq_u32_f32(finite));
        vreinterpretq_f32_u32(vorrq_u32(bits, s))
    };
    [
        widen(vshll_n_u16::<13>(vget_low_u16(mag)), vshll_n_u16::<16>(vget_low_u16(sign))),
        widen(vshll_high_n_u16::<13>(mag), vshll_high_n_u16::<16>(sign)),
    ]
}

/// `facc[q] = fma(isum(rows 4q..4q+4), d_w * d_a, facc[q])` for one finished block.
#[inline(always)]
unsafe fn scale_block(acc: &[int16x8_t; 4], scales: *const u16, da: f32, facc: &mut [float32x4_t; 8]) {
    let vda = vdupq_n_f32(da);
    for (q, &s) in acc.iter().enumerate() {
        let dw = fp16_to_f32(vld1q_u16(scales.add(8 * q)));
        let isum = [vcvtq_f32_s32(vmovl_s16(vget_low_s16(s))), vcvtq_f32_s32(vmovl_high_s16(s))];
        for k in 0..2 {
            facc[2 * q + k] = vfmaq_f32(facc[2 * q + k], isum[k], vmulq_f32(dw[k], vda));
        }
    }
}

#[inline(always)]
unsafe fn store(facc: &[float32x4_t; 8], out: &mut [f32]) {
    assert!(out.len() >= TILE_ROWS);
    for (q, f) in facc.iter().enumerate() {
        vst1q_f32(out.as_mut_ptr().add(4 * q), *f);
    }
}

#[target_feature(enable = "neon")]
unsafe fn gemv_tile(p: &LutPacked, t: usize, tables: *const u8, scales: &[f32], out: &mut [f32]) {
    let mut facc = [vdupq_n_f32(0.0); 8];
    for (b, &da) in scales.iter().enumerate() {
        let bits = p.bits.as_ptr().add((t * p.kb + b) * TILE_BLOCK_BYTES);
        let tb = tables.add(b * 32 * TABLE_BYTES);
        let mut acc = [vdupq_n_s16(0); 4];
        for c in 0..16 {
            accumulate_chunk(&indices(bits, c), tb, c, &mut acc);
        }
        scale_block(&acc, p.tile_block_scales(t, b).as_ptr(), da, &mut facc);
    }
    store(&facc, out);
}

/// Rows of `tiles` (32 per tile, padding included) against one activation row's tables.
pub fn gemv_tiles(p: &LutPacked, tiles: Range<usize>, tables: &[u8], scales: &[f32], out: &mut [f32]) {
    assert!(tables.len() >= p.kb * 32 * TABLE_BYTES && scales.len() >= p.kb);
    assert!(out.len() >= tiles.len() * TILE_ROWS && tiles.end <= p.tiles);
    for (ti, t) in tiles.enumerate() {
        // SAFETY: NEON is baseline on aarch64 (and checked by the caller); all reads are within the
        // asserted lengths.
        unsafe { gemv_tile(p, t, tables.as_ptr(), &scales[..p.kb], &mut out[ti * TILE_ROWS..][..TILE_ROWS]) };
    }
}

/// `NC` (at most `GEMM_COLS`) activation rows against one tile: indices extracted once per chunk.
#[target_feature(enable = "neon")]
unsafe fn gemm_tile_cols<const NC: usize>(
    p: &LutPacked,
    t: usize,
    tables: [*const u8; NC],
    scales: [&[f32]; NC],
    out: [&mut [f32]; NC],
) {
    let mut facc = [[vdupq_n_f32(0.0); 8]; NC];
    #[allow(clippy::needless_range_loop)] // b indexes the bits, the tables and every column's scales
    for b in 0..p.kb {
        let bits = p.bits.as_ptr().add((t * p.kb + b) * TILE_BLOCK_BYTES);
        let mut acc = [[vdupq_n_s16(0); 4]; NC];
        for c in 0..16 {
            let idx = indices(bits, c);
            for j in 0..NC {
                accumulate_chunk(&idx, tables[j].add(b * 32 * TABLE_BYTES), c, &mut acc[j]);
            }
        }
        let ws = p.tile_block_scales(t, b).as_ptr();
        for j in 0..NC {
            scale_block(&acc[j], ws, scales[j][b], &mut facc[j]);
        }
    }
    for (o, f) in out.into_iter().zip(facc) {
        store(&f, o);
    }
}

/// `out[j * rows + r]` for `n` activation rows (tables and scales stored one row after another).
pub fn gemm_tiles(p: &LutPacked, tiles: Range<usize>, n: usize, tables: &[u8], scales: &[f32], out: &mut [f32]) {
    let col_tables = p.kb * 32 * TABLE_BYTES;
    let rows = tiles.len() * TILE_ROWS;
    assert!(tables.len() >= n * col_tables && scales.len() >= n * p.kb && out.len() >= n * rows);
    assert!(tiles.end <= p.tiles);
    for (ti, t) in tiles.enumerate() {
        let mut j = 0;
        while j < n {
            let nc = (n - j).min(GEMM_COLS);
            let tab = |c: usize| tables[(j + c) * col_tables..].as_ptr();
            let sc = |c: usize| &scales[(j + c) * p.kb..(j + c + 1) * p.kb];
            let mut outs = out.chunks_exact_mut(rows).skip(j).map(|o| &mut o[ti * TILE_ROWS..][..TILE_ROWS]);
            let mut o = || outs.next().expect("n output columns");
            // SAFETY: NEON is baseline on aarch64; reads are within the asserted lengths.
            unsafe {
                match nc {
                    4 => gemm_tile_cols::<4>(
                        p,
                        t,
                        [tab(0), tab(1), tab(2), tab(3)],
                        [sc(0), sc(1), sc(2), sc(3)],
                        [o(), o(), o(), o()],
                    ),
                    3 => gemm_tile_cols::<3>(p, t, [tab(0), tab(1), tab(2)], [sc(0), sc(1), sc(2)], [o(), o(), o()]),
                    2 => gemm_tile_cols::<2>(p, t, [tab(0), tab(1)], [sc(0), sc(1)], [o(), o()]),
                    _ => gemm_tile_cols::<1>(p, t, [tab(0)], [sc(0)], [o()]),
                }
            }
            j += nc;
        }
    }
}

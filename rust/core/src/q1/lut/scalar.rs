//! Portable LUT kernels over the packed layout: the semantics every SIMD LUT kernel must match.

use std::ops::Range;

use half::f16;

use super::{LutPacked, TABLE_BYTES, TILE_ROWS};

#[inline]
fn entry(table: &[u8], c: u8) -> i32 {
    i32::from(i16::from_le_bytes([table[usize::from(c)], table[16 + usize::from(c)]]))
}

/// Exact integer sum of row `r` of a tile-block against the tables of that block's 32 groups.
#[inline]
fn block_sum(bits: &[u8], tables: &[u8], r: usize) -> i32 {
    (0..16)
        .map(|c| {
            let byte = bits[32 * c + r];
            let t0 = &tables[(2 * c) * TABLE_BYTES..];
            let t1 = &tables[(2 * c + 1) * TABLE_BYTES..];
            entry(t0, byte & 0x0f) + entry(t1, byte >> 4)
        })
        .sum()
}

/// Rows of `tiles` (32 per tile, padding included) against one activation row's tables.
pub fn gemv_tiles(p: &LutPacked, tiles: Range<usize>, tables: &[u8], scales: &[f32], out: &mut [f32]) {
    gemm_tiles(p, tiles, 1, tables, scales, out)
}

/// `out[j * rows + r]` for `n` activation rows whose tables and scales are stored one after another.
pub fn gemm_tiles(p: &LutPacked, tiles: Range<usize>, n: usize, tables: &[u8], scales: &[f32], out: &mut [f32]) {
    let rows = tiles.len() * TILE_ROWS;
    let col_tables = p.kb * 32 * TABLE_BYTES;
    for (ti, t) in tiles.enumerate() {
        for j in 0..n {
            let acc = &mut out[j * rows + ti * TILE_ROWS..][..TILE_ROWS];
            acc.fill(0.0);
            for b in 0..p.kb {
                let bits = p.tile_block_bits(t, b);
                let tb = &tables[j * col_tables + b * 32 * TABLE_BYTES..];
                let da = scales[j * p.kb + b];
                for (r, (a, &s)) in acc.iter_mut().zip(p.tile_block_scales(t, b)).enumerate() {
                    let dw = f16::from_bits(s).to_f32();
                    *a = (block_sum(bits, tb, r) as f32).mul_add(dw * da, *a);
                }
            }
        }
    }
}

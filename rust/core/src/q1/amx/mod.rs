//! The AMX-INT8 small GEMM, for Xeons with Intel AMX (Sapphire Rapids and later), where `Gemm` and
//! `Auto` run it instead of the 6-bit lookup GEMM from 12 activation rows (`matrix::AMX_MIN_ROWS`).
//!
//! One `tdpbssd` (16 x 16 x 64 int8 products) took ~7 ns on an Emerald Rapids Xeon, a tile load ~6
//! and a tile store ~10, and the tile unit barely overlaps them (BENCHMARKS.md, session 11). So a
//! pass loads each activation group's block tiles once and reuses them for every weight tile of the
//! pass (two weight tiles in and one product tile out per step; the per-block scales force the
//! store), while the vector units turn sign bits into ±1 bytes and scale each block's sums.
//! Results are transposed in registers and written as contiguous output rows (session 31).
//! Weights are read straight from the GGUF blocks (no repacking; the scales come from the LUT
//! repacking, which decode builds anyway); activations are rearranged once per call ([`acts`]).
//! Each output is computed by one task in block order, so results do not depend on the thread count
//! and equal the LUT GEMV's bit for bit.
//!
//! - [`detect`]: whether the CPU has AMX-INT8 and Linux lets this process use it.
//! - [`unit`]: the tile products (AMX, and a plain-loop emulation the tests run anywhere).
//! - [`kernel`]: a pass of up to four 16-row weight tiles against every activation row.

mod acts;
mod detect;
mod kernel;
#[cfg(test)]
mod tests;
mod unit;

pub use detect::available;

use std::ops::Range;

use crate::pool::Pool;
use crate::q1::act::QuantizedActs;
use crate::q1::lut::LutPacked;
use crate::q1::par::SharedOut;
use crate::q1::BlockQ1;

use acts::{ActTiles, TILE_COLS};
use kernel::{pass, transposed, TileResult, WeightRows, PASS_TILES, TILE_ROWS};
use unit::{Amx, TileUnit};

/// `outs[i][j * rows + r]` = row `r` of matrix `i` (`blocks`, `packed`) times activation row `j`.
///
/// # Panics
/// If AMX is not [`available`].
pub fn gemm_shared(mats: &[(&[BlockQ1], &LutPacked)], acts: &QuantizedActs, outs: &mut [&mut [f32]], pool: &Pool) {
    assert!(available(), "the AMX GEMM needs AMX-INT8 (see amx::available)");
    gemm_with(|| Amx, mats, acts, outs, pool);
}

fn gemm_with<U: TileUnit>(
    new_unit: impl Fn() -> U + Sync,
    mats: &[(&[BlockQ1], &LutPacked)],
    acts: &QuantizedActs,
    outs: &mut [&mut [f32]],
    pool: &Pool,
) {
    let tiles = ActTiles::new(acts, pool);
    for (&(blocks, packed), out) in mats.iter().zip(outs.iter_mut()) {
        let w = WeightRows { blocks, packed };
        assert_eq!(blocks.len(), w.rows() * packed.kb, "blocks and repacking disagree");
        assert_eq!(out.len(), acts.n * w.rows(), "output must hold n x rows values");
        let shared = SharedOut::new(out);
        pool.for_each_range(w.tiles().div_ceil(PASS_TILES), 1, |passes| {
            let mut unit = new_unit();
            let mut results = Vec::new();
            // SAFETY: `gemm_shared` checked AVX-512 and AMX (`available`); the tests' emulation needs
            // only AVX-512, which they check. Each task writes only its own tiles' rows.
            unsafe {
                unit.begin();
                for first in passes.map(|p| p * PASS_TILES) {
                    let pass_tiles = first..(first + PASS_TILES).min(w.tiles());
                    pass(&mut unit, &w, pass_tiles.clone(), &tiles, &mut results);
                    write_results(&results, &w, pass_tiles, &tiles, &shared);
                }
                unit.end();
            }
        });
    }
}

/// Writes a pass's results (weight rows by activation rows, per tile and group) to their places in
/// `out` (activation rows by weight rows), dropping padding rows: each result is transposed in
/// registers, so each activation row's values are one contiguous store.
///
/// # Safety
/// No other task writes these tiles' rows; AVX-512 F is available.
#[target_feature(enable = "avx512f")]
unsafe fn write_results(results: &[TileResult], w: &WeightRows, tiles: Range<usize>, acts: &ActTiles, out: &SharedOut) {
    for (i, tile) in tiles.enumerate() {
        let r0 = tile * TILE_ROWS;
        let rows = (w.rows() - r0).min(TILE_ROWS);
        for g in 0..acts.groups {
            let by_act_row = transposed(&results[i * acts.groups + g]);
            for (n, values) in by_act_row[..acts.rows_in(g)].iter().enumerate() {
                let start = (g * TILE_COLS + n) * w.rows() + r0;
                if rows == TILE_ROWS {
                    out.write(start, values);
                } else {
                    out.write(start, &values[..rows]);
                }
            }
        }
    }
}

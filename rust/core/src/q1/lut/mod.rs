//! The lookup-table (LUT) kernels: T-MAC / BitNet-TL style GEMV and small GEMM.
//!
//! Weights are repacked once into tiles of 32 rows ([`LutPacked`]). For every group of 4 int8
//! activations the kernels build the exact 16-entry table of `±a0 ±a1 ±a2 ±a3` (int16, stored as a
//! low-byte plane and a high-byte plane); one byte shuffle then looks up 4 weights of many rows at
//! once. Within a 128-block the int16 sums are exact: 32 groups x 4 x 127 = 16256 < 32767. Each
//! block's exact integer sum is scaled as `acc = fma(isum, d_w * d_a, acc)`, the same operation in
//! the same order as every other int8 kernel, so all of them agree bit for bit.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;
mod pack;
mod scalar;
mod tables;

pub use pack::{LutPacked, TILE_BLOCK_BYTES, TILE_ROWS};
pub use tables::{build_tables, TABLE_BYTES};

use super::act::QuantizedActs;
use super::par::SharedOut;
use super::Isa;
use crate::pool::Pool;

/// Columns of activations one GEMM pass handles together.
pub const GEMM_MAX_COLS: usize = 64;

/// `out[i, r] = sum_k w[r, k] * x[i, k]` for every activation row `i` separately (GEMV per row).
pub fn gemv(p: &LutPacked, acts: &QuantizedActs, out: &mut [f32], isa: Isa, pool: &Pool) {
    let groups = acts.k / 4;
    let mut generic = vec![0u8; groups * TABLE_BYTES];
    let mut arranged = Vec::new();
    for i in 0..acts.n {
        build_tables(acts.row(i), &mut generic, isa);
        let tables = gemv_tables(&generic, &mut arranged, isa);
        let scales = &acts.scale[i * p.kb..(i + 1) * p.kb];
        let out_row = SharedOut::new(&mut out[i * p.rows..(i + 1) * p.rows]);
        pool.for_each_range(p.tiles, 1, |tiles| {
            let mut buf = vec![0f32; tiles.len() * TILE_ROWS];
            gemv_tiles(p, tiles.clone(), tables, scales, &mut buf, isa);
            let end = (tiles.end * TILE_ROWS).min(p.rows);
            // SAFETY: each task owns the rows of its own tiles.
            unsafe { out_row.write(tiles.start * TILE_ROWS, &buf[..end - tiles.start * TILE_ROWS]) };
        });
    }
}

/// The tables in the layout the GEMV kernel of `isa` reads.
fn gemv_tables<'a>(generic: &'a [u8], arranged: &'a mut Vec<u8>, isa: Isa) -> &'a [u8] {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() {
        avx512::arrange_tables(generic, arranged);
        return arranged;
    }
    let _ = (isa, arranged);
    generic
}

fn gemv_tiles(p: &LutPacked, tiles: std::ops::Range<usize>, tables: &[u8], scales: &[f32], out: &mut [f32], isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa.has_avx512() {
            return avx512::gemv_tiles(p, tiles, tables, scales, out);
        }
        if isa.has_avx2() {
            return avx2::gemv_tiles(p, tiles, tables, scales, out);
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        return neon::gemv_tiles(p, tiles, tables, scales, out);
    }
    let _ = isa;
    scalar::gemv_tiles(p, tiles, tables, scales, out)
}

/// Small GEMM: like [`gemv`], but each tile of weights is decoded once for up to
/// [`GEMM_MAX_COLS`] activation rows.
pub fn gemm(p: &LutPacked, acts: &QuantizedActs, out: &mut [f32], isa: Isa, pool: &Pool) {
    let groups = acts.k / 4;
    for first in (0..acts.n).step_by(GEMM_MAX_COLS) {
        let n = (acts.n - first).min(GEMM_MAX_COLS);
        let mut tables = vec![0u8; n * groups * TABLE_BYTES];
        for (j, t) in tables.chunks_exact_mut(groups * TABLE_BYTES).enumerate() {
            build_tables(acts.row(first + j), t, isa);
        }
        let scales = &acts.scale[first * p.kb..(first + n) * p.kb];
        let shared = SharedOut::new(&mut out[first * p.rows..(first + n) * p.rows]);
        pool.for_each_range(p.tiles, 1, |tiles| {
            let rows = tiles.len() * TILE_ROWS;
            let mut buf = vec![0f32; n * rows];
            gemm_tiles(p, tiles.clone(), n, &tables, scales, &mut buf, isa);
            let r0 = tiles.start * TILE_ROWS;
            let valid = (tiles.end * TILE_ROWS).min(p.rows) - r0;
            for j in 0..n {
                // SAFETY: each task owns the rows of its own tiles, in every column.
                unsafe { shared.write(j * p.rows + r0, &buf[j * rows..j * rows + valid]) };
            }
        });
    }
}

/// Writes `out[j * (tiles.len() * 32) + row]` for the `n` activation rows `j`.
fn gemm_tiles(
    p: &LutPacked,
    tiles: std::ops::Range<usize>,
    n: usize,
    tables: &[u8],
    scales: &[f32],
    out: &mut [f32],
    isa: Isa,
) {
    // The AVX2 GEMM also serves AVX-512 machines: a 512-bit version of it measured 20-40% slower
    // on Zen 4 (double-pumped 512-bit shuffles, twice the table bytes per column).
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        return avx2::gemm_tiles(p, tiles, n, tables, scales, out);
    }
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        return neon::gemm_tiles(p, tiles, n, tables, scales, out);
    }
    let _ = isa;
    scalar::gemm_tiles(p, tiles, n, tables, scales, out)
}

/// The GEMV kernel that runs for `isa`, e.g. `"lut-avx512"`.
pub fn gemv_name(isa: Isa) -> String {
    format!("lut-{isa}")
}

/// The small-GEMM kernel that runs for `isa`.
pub fn gemm_name(isa: Isa) -> String {
    let code = if isa == Isa::Avx512 { Isa::Avx2 } else { isa };
    format!("lut-gemm-{code}")
}

//! The AMX GEMM against the LUT GEMV (one activation row at a time), bit for bit: through the
//! plain-loop tile emulation on any AVX-512 machine, and through the real tile unit where the CPU has
//! AMX-INT8 (skipped elsewhere, saying so).

use super::acts::{ActTiles, BLOCK_BYTES};
use super::kernel::{transposed, TileResult};
use super::unit::{Emulated, TILE_BYTES};
use super::{available, gemm_shared, gemm_with};
use crate::pool::Pool;
use crate::q1::act::{quantize_acts, QuantizedActs};
use crate::q1::test_support::{avx512, fresh_rng};
use crate::q1::{Isa, Kernel, Q1Matrix};

/// Fresh pseudo-random normal-ish values (seed printed).
fn values(len: usize, what: &str) -> Vec<f32> {
    let mut rng = fresh_rng(what);
    (0..len)
        .map(|_| {
            let x = rng.next_u64();
            // A sum of four uniforms: roughly normal, sometimes large.
            let u = (0..4).map(|i| ((x >> (16 * i)) & 0xffff) as f32 / 65536.0 - 0.5).sum::<f32>();
            if x.is_multiple_of(997) {
                40.0 * u
            } else {
                u
            }
        })
        .collect()
}

/// Each activation row alone through the LUT GEMV: what the GEMM must equal bit for bit.
fn gemv_rows(m: &Q1Matrix, x: &[f32], n: usize, pool: &Pool) -> Vec<f32> {
    let mut want = vec![f32::NAN; n * m.rows()];
    for (xi, wi) in x.chunks_exact(m.cols()).zip(want.chunks_exact_mut(m.rows())) {
        m.matmul(xi, 1, wi, Kernel::Lut, Isa::Scalar, pool).unwrap();
    }
    want
}

fn emulated(m: &Q1Matrix, acts: &QuantizedActs, pool: &Pool) -> Vec<f32> {
    let mut got = vec![f32::NAN; acts.n * m.rows()];
    gemm_with(Emulated::new, &[(m.blocks(), m.packed())], acts, &mut [&mut got], pool);
    got
}

const SHAPES: [(usize, usize); 5] = [(1, 128), (16, 256), (17, 128), (33, 384), (100, 256)];
const NS: [usize; 6] = [1, 2, 15, 16, 17, 33];

#[test]
fn emulated_tiles_give_the_lut_gemv_bit_for_bit() {
    if !avx512() {
        return;
    }
    for threads in [1, 3] {
        let pool = Pool::new(threads);
        for (rows, cols) in SHAPES {
            let m = Q1Matrix::quantize(&values(rows * cols, "weights"), rows, cols).unwrap();
            for n in NS {
                let x = values(n * cols, "activations");
                let acts = quantize_acts(&x, n, cols, Isa::Scalar).unwrap();
                let got = emulated(&m, &acts, &pool);
                assert_eq!(got, gemv_rows(&m, &x, n, &pool), "({rows}, {cols}) n={n} threads={threads}");
            }
        }
    }
}

#[test]
fn amx_tiles_give_what_the_emulation_gives() {
    if !available() {
        println!("skipped: no AMX-INT8 here (or Linux refused the tile state)");
        return;
    }
    let pool = Pool::new(3);
    for (rows, cols) in SHAPES {
        let m = Q1Matrix::quantize(&values(rows * cols, "weights"), rows, cols).unwrap();
        for n in NS {
            let acts = quantize_acts(&values(n * cols, "activations"), n, cols, Isa::Scalar).unwrap();
            let mut got = vec![f32::NAN; n * rows];
            gemm_shared(&[(m.blocks(), m.packed())], &acts, &mut [&mut got], &pool);
            assert_eq!(got, emulated(&m, &acts, &pool), "({rows}, {cols}) n={n}");
        }
    }
}

#[test]
fn act_tiles_put_each_value_where_the_tile_unit_reads_it() {
    if !avx512() {
        return;
    }
    let (n, cols) = (19, 256);
    let acts = quantize_acts(&values(n * cols, "activations"), n, cols, Isa::Scalar).unwrap();
    let tiles = ActTiles::new(&acts, &Pool::new(3));
    assert_eq!((tiles.groups, tiles.rows_in(0), tiles.rows_in(1)), (2, 16, 3));
    for g in 0..2 {
        for b in 0..2 {
            // SAFETY: `block` points at the block's four tiles.
            let block = unsafe { std::slice::from_raw_parts(tiles.block(g, b), BLOCK_BYTES) };
            let (high, low) = block.split_at(2 * TILE_BYTES);
            for col in 0..16 {
                let i = 16 * g + col;
                for k in 0..128 {
                    let at = (k / 64) * TILE_BYTES + 64 * ((k % 64) / 4) + 4 * col + k % 4;
                    let want = if i < n { acts.q[i * cols + 128 * b + k] } else { 0 };
                    let got = 256 * i32::from(high[at] as i8) + i32::from(low[at] as i8);
                    assert_eq!(got, i32::from(want), "group {g} block {b} row {i} value {k}");
                }
                let scale = if i < n { acts.scale[i * 2 + b] } else { 0.0 };
                assert_eq!(tiles.scales(g, b)[col], scale);
            }
        }
    }
}

#[test]
fn results_transpose_in_registers_as_in_a_plain_loop() {
    if !avx512() {
        return;
    }
    let v = values(256, "tile result");
    let result: TileResult = std::array::from_fn(|m| std::array::from_fn(|n| v[16 * m + n]));
    // SAFETY: AVX-512 checked above.
    let got = unsafe { transposed(&result) };
    for (n, row) in got.iter().enumerate() {
        for (m, &x) in row.iter().enumerate() {
            assert_eq!(x.to_bits(), result[m][n].to_bits(), "[{n}][{m}]");
        }
    }
}

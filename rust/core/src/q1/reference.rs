//! Reference kernels: plain loops that define what the fast kernels compute.
//!
//! [`gemv_f32`] is the portable kernel over f32 activations (no activation quantization), exposed as
//! `kernel="reference"`. [`exact_quantized`] computes, in f64, the value every quantized kernel
//! approximates over the same quantized weights and activations; tests compare the fast kernels with
//! it.

use super::act::QuantizedActs;
use super::block::{BlockQ1, BLOCK_WEIGHTS};
use super::par::SharedOut;
use crate::pool::Pool;

/// Dot product of one GGUF-layout row with f32 activations, accumulated in f32 per block.
pub fn row_dot_f32(row: &[BlockQ1], x: &[f32]) -> f32 {
    row.iter()
        .zip(x.chunks_exact(BLOCK_WEIGHTS))
        .map(|(block, xb)| {
            let signed: f32 = xb.iter().enumerate().map(|(j, &v)| if block.is_positive(j) { v } else { -v }).sum();
            block.scale() * signed
        })
        .sum()
}

/// `out[i, r] = sum_k w[r, k] * x[i, k]` with f32 activations, parallel over rows.
pub fn gemv_f32(blocks: &[BlockQ1], rows: usize, cols: usize, x: &[f32], n: usize, out: &mut [f32], pool: &Pool) {
    let kb = cols / BLOCK_WEIGHTS;
    for i in 0..n {
        let xi = &x[i * cols..(i + 1) * cols];
        let shared = SharedOut::new(&mut out[i * rows..(i + 1) * rows]);
        pool.for_each_range(rows, 16, |range| {
            let sums: Vec<f32> = range.clone().map(|r| row_dot_f32(&blocks[r * kb..(r + 1) * kb], xi)).collect();
            // SAFETY: each task owns its range of rows.
            unsafe { shared.write(range.start, &sums) };
        });
    }
}

/// The exact value of every quantized kernel's output, in f64: `sum_b d_w * d_a * sum_j s_j * q_j`.
pub fn exact_quantized(blocks: &[BlockQ1], rows: usize, acts: &QuantizedActs) -> Vec<f64> {
    let (n, k, q_all, scales) = (acts.n, acts.k, &acts.q, &acts.scale);
    let kb = k / BLOCK_WEIGHTS;
    let mut out = vec![0f64; n * rows];
    for i in 0..n {
        let q = &q_all[i * k..(i + 1) * k];
        for r in 0..rows {
            out[i * rows + r] = (0..kb)
                .map(|b| {
                    let block = &blocks[r * kb + b];
                    let isum: i64 = (0..BLOCK_WEIGHTS)
                        .map(|j| {
                            let v = i64::from(q[b * BLOCK_WEIGHTS + j]);
                            if block.is_positive(j) {
                                v
                            } else {
                                -v
                            }
                        })
                        .sum();
                    f64::from(block.scale()) * f64::from(scales[i * kb + b]) * isum as f64
                })
                .sum();
        }
    }
    out
}

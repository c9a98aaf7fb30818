//! int16 activations with one scale per 128 values, the scale chosen so that each block's sum of
//! `|q|` is at most 32767 (issue 26's measured choice: about 0.2x the logit error of llama.cpp's
//! per-32 int8 on plain and massive-activation models). Every signed sum of a block's values, a
//! lookup-table entry or an int16 accumulator, is then exact in int16, so the LUT kernels keep their
//! int16 tables and accumulators. This module is the definition the kernels will follow; none uses
//! it yet.
//!
//! Rule per block (the same bits on every ISA: the L1 estimate is an integer sum, order-free):
//! `amax = max |x|`; `t = sum floor(|x| * (65536 / amax))`; `scale = (t + 128) * (amax / 65536) /
//! 32639`; `q = round_half_even(x / scale)`. Since `|x| * 65536 / amax < floor(...) + 1`, the block's
//! L1 norm is below `(t + 128) * amax / 65536`, so `sum |q| <= 32639 + 128 / 2 < 32767`. An all-zero
//! block has scale 0 and q = 0; non-finite input is an error.

use super::block::BLOCK_WEIGHTS;
use crate::error::{Error, Result};

/// Fixed-point resolution of the L1 estimate.
pub const L1_FIXED: f32 = 65536.0;
/// The L1 budget the scale targets: 32767 less the rounding slack of 128 values.
pub const L1_BUDGET: f32 = 32639.0;

/// `n` rows of `k` activations quantized to int16, one scale and one sum per 128 values.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedActs16 {
    pub n: usize,
    pub k: usize,
    /// `n * k` int16 values, row-major; every block's sum of `|q|` is at most 32767.
    pub q: Vec<i16>,
    /// `n * k / 128` scales.
    pub scale: Vec<f32>,
    /// `n * k / 128` sums of each block's values.
    pub sum: Vec<i32>,
}

impl QuantizedActs16 {
    pub fn blocks_per_row(&self) -> usize {
        self.k / BLOCK_WEIGHTS
    }

    pub fn row(&self, i: usize) -> &[i16] {
        &self.q[i * self.k..(i + 1) * self.k]
    }
}

/// Quantizes `n` rows of `k` f32 values (`k % 128 == 0`).
pub fn quantize_acts_i16(x: &[f32], n: usize, k: usize) -> Result<QuantizedActs16> {
    assert_eq!(x.len(), n * k);
    assert_eq!(k % BLOCK_WEIGHTS, 0);
    let blocks = n * k / BLOCK_WEIGHTS;
    let mut out = QuantizedActs16 { n, k, q: vec![0; n * k], scale: vec![0.0; blocks], sum: vec![0; blocks] };
    let chunks = x.chunks_exact(BLOCK_WEIGHTS).zip(out.q.chunks_exact_mut(BLOCK_WEIGHTS));
    for (i, (xb, qb)) in chunks.enumerate() {
        if let Some(at) = xb.iter().position(|v| !v.is_finite()) {
            let at = i * BLOCK_WEIGHTS + at;
            return Err(Error::Value(format!(
                "activations must be finite, found {} at ({}, {})",
                x[at],
                at / k,
                at % k
            )));
        }
        (out.scale[i], out.sum[i]) = quantize_block(xb, qb);
    }
    Ok(out)
}

/// One block: its scale and the sum of its values.
fn quantize_block(xb: &[f32], qb: &mut [i16]) -> (f32, i32) {
    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return (0.0, 0);
    }
    let fixed = L1_FIXED / amax;
    let t: u64 = xb.iter().map(|v| (v.abs() * fixed).floor() as u64).sum();
    let scale = (t + BLOCK_WEIGHTS as u64) as f32 * (amax / L1_FIXED) / L1_BUDGET;
    let inv = 1.0 / scale;
    let mut sum = 0i32;
    for (q, v) in qb.iter_mut().zip(xb) {
        *q = (v * inv).round_ties_even() as i16;
        sum += i32::from(*q);
    }
    (scale, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l1(q: &[i16]) -> i64 {
        q.iter().map(|&v| i64::from(v).abs()).sum()
    }

    /// A deterministic spread of magnitudes, with a few values thousands of times larger.
    fn massive(seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..BLOCK_WEIGHTS * 6)
            .map(|j| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let v = (s % 20_000) as f32 / 10_000.0 - 1.0;
                if j % 97 == 5 {
                    v * 3000.0
                } else {
                    v
                }
            })
            .collect()
    }

    #[test]
    fn every_block_keeps_its_l1_norm_within_int16() {
        for seed in 1..200 {
            let x = massive(seed);
            let acts = quantize_acts_i16(&x, 1, x.len()).unwrap();
            for (b, q) in acts.q.chunks_exact(BLOCK_WEIGHTS).enumerate() {
                assert!(l1(q) <= 32767, "seed {seed} block {b}: sum |q| = {}", l1(q));
                assert_eq!(acts.sum[b], q.iter().map(|&v| i32::from(v)).sum::<i32>());
            }
        }
        // The worst case for the bound: every value equal.
        let flat = vec![1.0f32; BLOCK_WEIGHTS];
        assert!(l1(&quantize_acts_i16(&flat, 1, BLOCK_WEIGHTS).unwrap().q) <= 32767);
    }

    #[test]
    fn values_come_back_far_more_exactly_than_int8() {
        let x = massive(7);
        let acts = quantize_acts_i16(&x, 1, x.len()).unwrap();
        let back = |j: usize| f64::from(acts.q[j]) * f64::from(acts.scale[j / BLOCK_WEIGHTS]);
        let err: f64 = (0..x.len()).map(|j| (back(j) - f64::from(x[j])).powi(2)).sum();
        let norm: f64 = x.iter().map(|&v| f64::from(v).powi(2)).sum();
        assert!(err / norm < 1e-7, "relative squared error {}", err / norm);
    }

    #[test]
    fn zero_blocks_and_bad_input() {
        let acts = quantize_acts_i16(&[0.0; BLOCK_WEIGHTS], 1, BLOCK_WEIGHTS).unwrap();
        assert!(acts.q.iter().all(|&q| q == 0) && acts.scale == vec![0.0]);
        let mut x = vec![1.0f32; 2 * BLOCK_WEIGHTS];
        x[130] = f32::NAN;
        let err = quantize_acts_i16(&x, 1, x.len()).unwrap_err().to_string();
        assert!(err.contains("(0, 130)"), "{err}");
    }
}

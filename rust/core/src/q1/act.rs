//! Activation quantization: f32 rows to int16 with one scale per 128 values (aligned with the weight
//! blocks), plus each block's sum, which the kernels share across all weight rows.
//!
//! The scale bounds each block's L1 norm: `sum |q| <= 32639` (issue 26's measured choice: about 0.2x
//! the logit error of llama.cpp's per-32 int8, on plain models and on models with massive activation
//! channels, where one value of a block is 100x the rest). Every signed sum of a block's values, a
//! lookup-table entry or an int16 accumulator, is then exact in int16, so the LUT kernels keep their
//! int16 tables and accumulators; and every value splits into two signed bytes ([`byte_planes`]) for
//! the int8 dot-product units (VNNI, AMX).
//!
//! Rule per block (the same bits on every ISA: the L1 estimate is an integer sum, order-free):
//! `amax = max |x|`; `t = sum floor(|x| * (65536 / amax))`; `scale = (t + 128) * (amax / 65536) /
//! 32575`; `q = round_half_even(x * (1 / scale))`. Since `|x| * 65536 / amax < floor(...) + 1`, the
//! block's L1 norm is below `(t + 128) * amax / 65536`, so `sum |q| <= 32575 + 128 / 2 = 32639`.
//! A block whose `amax` is below 2^-96 (zero included) has scale 0 and q = 0, which keeps every step
//! of the rule finite. Non-finite input is an error.

use std::sync::Mutex;

use super::block::BLOCK_WEIGHTS;
use super::Isa;
use crate::error::{Error, Result};
use crate::pool::Pool;

/// Fixed-point resolution of the L1 estimate.
pub const L1_FIXED: f32 = 65536.0;
/// The L1 budget the scale targets: 32639 less the rounding slack of 128 values.
pub const L1_BUDGET: f32 = 32575.0;
/// Every block's `sum |q|` is at most this, hence so is every `|q|`.
pub const L1_MAX: i32 = 32639;
/// Blocks whose largest magnitude is below this quantize to zero (2^-96).
pub const MIN_AMAX: f32 = f32::from_bits((127 - 96) << 23);

/// `n` rows of `k` activations quantized to int16, one scale and one sum per 128 values.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedActs {
    pub n: usize,
    pub k: usize,
    /// `n * k` int16 values, row-major; every block's sum of `|q|` is at most [`L1_MAX`].
    pub q: Vec<i16>,
    /// `n * k / 128` scales.
    pub scale: Vec<f32>,
    /// `n * k / 128` sums of the values of each block.
    pub sum: Vec<i32>,
}

impl QuantizedActs {
    pub fn blocks_per_row(&self) -> usize {
        self.k / BLOCK_WEIGHTS
    }

    /// The values of activation row `i`.
    pub fn row(&self, i: usize) -> &[i16] {
        &self.q[i * self.k..(i + 1) * self.k]
    }
}

/// `q = 256 * high + low` with both parts signed bytes: `low` is the low byte of `q` read as signed,
/// `high = (q - low) / 256`. Exact for `-32768 <= q <= 32639` (every quantized value), where `high`
/// stays within -128..=127.
#[inline]
pub fn byte_planes(q: i16) -> (i8, i8) {
    let low = q as i8;
    (((i32::from(q) - i32::from(low)) >> 8) as i8, low)
}

/// Quantizes `n` rows of `k` f32 values (`k % 128 == 0`) with the kernel of `isa`.
pub fn quantize_acts(x: &[f32], n: usize, k: usize, isa: Isa) -> Result<QuantizedActs> {
    assert_eq!(x.len(), n * k);
    let mut out = QuantizedActs::zeros(n, k);
    let QuantizedActs { q, scale, sum, .. } = &mut out;
    quantize_rows(x, 0, k, Rows { q, scale, sum }, isa)?;
    Ok(out)
}

/// [`quantize_acts`] with the rows split across `pool` (the same bytes: each row is quantized by one
/// task, alone). On a non-finite input the error names the first one in row-major order.
pub fn quantize_acts_on(x: &[f32], n: usize, k: usize, isa: Isa, pool: &Pool) -> Result<QuantizedActs> {
    assert_eq!(x.len(), n * k);
    let mut out = QuantizedActs::zeros(n, k);
    let shared = SharedRows { q: out.q.as_mut_ptr(), scale: out.scale.as_mut_ptr(), sum: out.sum.as_mut_ptr() };
    let first_error: Mutex<Option<(usize, Error)>> = Mutex::new(None);
    pool.for_each_range(n, MIN_VALUES_PER_TASK.div_ceil(k.max(1)), |rows| {
        // SAFETY: the ranges of rows are disjoint, so each task's slices are its own; the buffers
        // outlive the pool job.
        let out = unsafe { shared.rows(rows.clone(), k) };
        if let Err(e) = quantize_rows(&x[rows.start * k..rows.end * k], rows.start, k, out, isa) {
            let mut first = first_error.lock().unwrap_or_else(|p| p.into_inner());
            if first.as_ref().is_none_or(|(row, _)| rows.start < *row) {
                *first = Some((rows.start, e));
            }
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some((_, e)) => Err(e),
        None => Ok(out),
    }
}

/// Values one pool task of [`quantize_acts_on`] takes at least (~10 µs of work).
const MIN_VALUES_PER_TASK: usize = 1 << 15;

impl QuantizedActs {
    fn zeros(n: usize, k: usize) -> QuantizedActs {
        assert_eq!(k % BLOCK_WEIGHTS, 0);
        let blocks = n * k / BLOCK_WEIGHTS;
        QuantizedActs { n, k, q: vec![0; n * k], scale: vec![0.0; blocks], sum: vec![0; blocks] }
    }
}

/// Some rows' part of each output of [`quantize_rows`].
struct Rows<'a> {
    q: &'a mut [i16],
    scale: &'a mut [f32],
    sum: &'a mut [i32],
}

/// The outputs' base pointers, shared by the tasks of [`quantize_acts_on`], each writing its own rows.
struct SharedRows {
    q: *mut i16,
    scale: *mut f32,
    sum: *mut i32,
}

// SAFETY: tasks only touch disjoint rows (see `rows`).
unsafe impl Sync for SharedRows {}

impl SharedRows {
    /// # Safety
    /// `rows` is within the buffers, and no other task holds any of these rows meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn rows(&self, rows: std::ops::Range<usize>, k: usize) -> Rows<'_> {
        let kb = k / BLOCK_WEIGHTS;
        Rows {
            q: std::slice::from_raw_parts_mut(self.q.add(rows.start * k), rows.len() * k),
            scale: std::slice::from_raw_parts_mut(self.scale.add(rows.start * kb), rows.len() * kb),
            sum: std::slice::from_raw_parts_mut(self.sum.add(rows.start * kb), rows.len() * kb),
        }
    }
}

/// Quantizes the rows `x` (row `first_row` onwards, `k` values each; the row numbers are for
/// errors) into `out`, which starts zeroed.
fn quantize_rows(x: &[f32], first_row: usize, k: usize, out: Rows, isa: Isa) -> Result<()> {
    assert!(x.len() == out.q.len() && x.len().is_multiple_of(BLOCK_WEIGHTS));
    let chunks = x.chunks_exact(BLOCK_WEIGHTS).zip(out.q.chunks_exact_mut(BLOCK_WEIGHTS));
    for (i, (xb, qb)) in chunks.enumerate() {
        let amax = block_amax(xb, isa);
        if !amax.is_finite() {
            let bad = xb.iter().find(|v| !v.is_finite()).copied().unwrap_or(amax);
            let at = i * BLOCK_WEIGHTS + xb.iter().position(|v| !v.is_finite()).unwrap_or(0);
            let (row, col) = (first_row + at / k, at % k);
            return Err(Error::Value(format!("activations must be finite, found {bad} at ({row}, {col})")));
        }
        if amax >= MIN_AMAX {
            let t = l1_estimate(xb, L1_FIXED / amax, isa);
            let scale = (t + BLOCK_WEIGHTS as u32) as f32 * (amax / L1_FIXED) / L1_BUDGET;
            out.scale[i] = scale;
            out.sum[i] = quantize_block(xb, 1.0 / scale, qb, isa);
        }
    }
    Ok(())
}

fn block_amax(xb: &[f32], isa: Isa) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 is present (checked by `Isa::has_avx2`, which only reports detected features).
        return unsafe { x86::block_amax(xb) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        // SAFETY: NEON is present (checked by `Isa::has_neon`).
        return unsafe { neon::block_amax(xb) };
    }
    let _ = isa;
    // NaN must propagate so the caller can report it: f32::max would drop it.
    xb.iter().fold(0.0f32, |m, v| if v.abs() > m || v.is_nan() { v.abs() } else { m })
}

/// `sum floor(|x| * fixed)` over a block, each term at most 65536 (`fixed = 65536 / amax`).
fn l1_estimate(xb: &[f32], fixed: f32, isa: Isa) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 is present.
        return unsafe { x86::l1_estimate(xb, fixed) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        // SAFETY: NEON is present.
        return unsafe { neon::l1_estimate(xb, fixed) };
    }
    let _ = isa;
    xb.iter().map(|v| (v.abs() * fixed).floor() as u32).sum()
}

/// Rounds `x * inv` half-to-even into int16 and returns the block sum.
fn quantize_block(xb: &[f32], inv: f32, qb: &mut [i16], isa: Isa) -> i32 {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 is present.
        return unsafe { x86::quantize_block(xb, inv, qb) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        // SAFETY: NEON is present (checked by `Isa::has_neon`).
        return unsafe { neon::quantize_block(xb, inv, qb) };
    }
    let _ = isa;
    let mut sum = 0i32;
    for (q, v) in qb.iter_mut().zip(xb) {
        *q = (v * inv).round_ties_even() as i16;
        sum += i32::from(*q);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// max |x| over a block; NaN anywhere yields NaN.
    #[target_feature(enable = "avx2")]
    pub unsafe fn block_amax(xb: &[f32]) -> f32 {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut m = _mm256_setzero_ps();
        let mut nan = _mm256_setzero_ps();
        for c in xb.chunks_exact(8) {
            let v = _mm256_and_ps(_mm256_loadu_ps(c.as_ptr()), abs_mask);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            m = _mm256_max_ps(m, v);
        }
        if _mm256_movemask_ps(nan) != 0 {
            return f32::NAN;
        }
        horizontal_max(m)
    }

    unsafe fn horizontal_max(m: __m256) -> f32 {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        lanes.iter().fold(0.0f32, |a, &b| a.max(b))
    }

    unsafe fn horizontal_sum(v: __m256i) -> i32 {
        let mut lanes = [0i32; 8];
        _mm256_storeu_si256(lanes.as_mut_ptr().cast(), v);
        lanes.iter().sum()
    }

    /// `sum floor(|x| * fixed)`: every term is an integer of at most 65536, so the int32 lanes and
    /// their total are exact.
    #[target_feature(enable = "avx2")]
    pub unsafe fn l1_estimate(xb: &[f32], fixed: f32) -> u32 {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let vfixed = _mm256_set1_ps(fixed);
        let mut t = _mm256_setzero_si256();
        for c in xb.chunks_exact(8) {
            let v = _mm256_mul_ps(_mm256_and_ps(_mm256_loadu_ps(c.as_ptr()), abs_mask), vfixed);
            t = _mm256_add_epi32(t, _mm256_cvttps_epi32(_mm256_floor_ps(v)));
        }
        horizontal_sum(t) as u32
    }

    /// Rounds `x * inv` half-to-even (the default MXCSR mode) into int16 and returns the block sum.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize_block(xb: &[f32], inv: f32, qb: &mut [i16]) -> i32 {
        let vinv = _mm256_set1_ps(inv);
        let mut sum = _mm256_setzero_si256();
        for (c, q) in xb.chunks_exact(16).zip(qb.chunks_exact_mut(16)) {
            let lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), vinv));
            let hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(c.as_ptr().add(8)), vinv));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(lo, hi));
            // packs works per 128-bit lane; the permute restores element order.
            let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(lo, hi));
            _mm256_storeu_si256(q.as_mut_ptr().cast(), w);
        }
        horizontal_sum(sum)
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    /// max |x| over a block; NaN anywhere yields NaN (`fmax` propagates it).
    #[target_feature(enable = "neon")]
    pub unsafe fn block_amax(xb: &[f32]) -> f32 {
        let mut m = [vdupq_n_f32(0.0); 4];
        for c in xb.chunks_exact(16) {
            for (k, mk) in m.iter_mut().enumerate() {
                *mk = vmaxq_f32(*mk, vabsq_f32(vld1q_f32(c.as_ptr().add(4 * k))));
            }
        }
        vmaxvq_f32(vmaxq_f32(vmaxq_f32(m[0], m[1]), vmaxq_f32(m[2], m[3])))
    }

    /// `sum floor(|x| * fixed)` (`fcvtmu`: convert rounding toward minus infinity), exact in u32.
    #[target_feature(enable = "neon")]
    pub unsafe fn l1_estimate(xb: &[f32], fixed: f32) -> u32 {
        let mut t = vdupq_n_u32(0);
        for c in xb.chunks_exact(4) {
            t = vaddq_u32(t, vcvtmq_u32_f32(vmulq_n_f32(vabsq_f32(vld1q_f32(c.as_ptr())), fixed)));
        }
        vaddvq_u32(t)
    }

    /// Rounds `x * inv` half-to-even (`fcvtns`) into int16 and returns the block sum.
    #[target_feature(enable = "neon")]
    pub unsafe fn quantize_block(xb: &[f32], inv: f32, qb: &mut [i16]) -> i32 {
        let mut sum = vdupq_n_s32(0);
        for (c, q) in xb.chunks_exact(8).zip(qb.chunks_exact_mut(8)) {
            let lo = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(c.as_ptr()), inv));
            let hi = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(c.as_ptr().add(4)), inv));
            sum = vaddq_s32(sum, vaddq_s32(lo, hi));
            vst1q_s16(q.as_mut_ptr(), vqmovn_high_s32(vqmovn_s32(lo), hi));
        }
        vaddvq_s32(sum)
    }
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
    fn every_block_keeps_its_l1_norm_within_the_bound_on_every_isa() {
        for isa in Isa::available() {
            for seed in 1..200 {
                let x = massive(seed);
                let acts = quantize_acts(&x, 1, x.len(), isa).unwrap();
                assert_eq!(acts, quantize_acts(&x, 1, x.len(), Isa::Scalar).unwrap(), "{isa} seed {seed}");
                for (b, q) in acts.q.chunks_exact(BLOCK_WEIGHTS).enumerate() {
                    assert!(l1(q) <= i64::from(L1_MAX), "seed {seed} block {b}: sum |q| = {}", l1(q));
                    assert_eq!(acts.sum[b], q.iter().map(|&v| i32::from(v)).sum::<i32>());
                }
            }
            // The worst cases for the bound: every value equal, and one value alone.
            let flat = vec![1.0f32; BLOCK_WEIGHTS];
            assert!(l1(&quantize_acts(&flat, 1, BLOCK_WEIGHTS, isa).unwrap().q) <= i64::from(L1_MAX));
            let mut alone = vec![0.0f32; BLOCK_WEIGHTS];
            alone[3] = -7.5;
            assert!(l1(&quantize_acts(&alone, 1, BLOCK_WEIGHTS, isa).unwrap().q) <= i64::from(L1_MAX));
        }
    }

    #[test]
    fn rows_split_across_a_pool_give_the_same_bytes_and_the_first_error() {
        let (n, k) = (200, 768); // several tasks of at least 43 rows
        let x: Vec<f32> = (0..n).flat_map(|r| massive(r as u32 + 1)[..k].to_vec()).collect();
        let want = quantize_acts(&x, n, k, Isa::detect()).unwrap();
        for threads in [1, 2, 5] {
            let pool = Pool::new(threads);
            assert_eq!(quantize_acts_on(&x, n, k, Isa::detect(), &pool).unwrap(), want, "{threads} threads");
            let mut bad = x.clone();
            bad[150 * k + 7] = f32::INFINITY;
            bad[5 * k + 700] = f32::NAN;
            let err = quantize_acts_on(&bad, n, k, Isa::detect(), &pool).unwrap_err().to_string();
            assert!(err.contains("(5, 700)"), "{threads} threads: {err}");
        }
    }

    #[test]
    fn values_come_back_far_more_exactly_than_int8() {
        let x = massive(7);
        let acts = quantize_acts(&x, 1, x.len(), Isa::Scalar).unwrap();
        let back = |j: usize| f64::from(acts.q[j]) * f64::from(acts.scale[j / BLOCK_WEIGHTS]);
        let err: f64 = (0..x.len()).map(|j| (back(j) - f64::from(x[j])).powi(2)).sum();
        let norm: f64 = x.iter().map(|&v| f64::from(v).powi(2)).sum();
        assert!(err / norm < 1e-7, "relative squared error {}", err / norm);
    }

    #[test]
    fn byte_planes_rebuild_every_value_in_range() {
        for q in i16::MIN..=L1_MAX as i16 {
            let (high, low) = byte_planes(q);
            assert_eq!(256 * i32::from(high) + i32::from(low), i32::from(q), "{q}");
        }
    }

    #[test]
    fn tiny_and_zero_blocks_quantize_to_zero_and_bad_input_is_named() {
        for isa in Isa::available() {
            let mut x = vec![0.0f32; 3 * BLOCK_WEIGHTS];
            x[BLOCK_WEIGHTS + 5] = 1e-30; // below 2^-96
            x[2 * BLOCK_WEIGHTS + 9] = 1e-28; // above: quantized, and finite
            let acts = quantize_acts(&x, 1, x.len(), isa).unwrap();
            assert_eq!(acts.scale[..2], [0.0, 0.0]);
            assert!(acts.q[..2 * BLOCK_WEIGHTS].iter().all(|&q| q == 0));
            assert!(acts.scale[2].is_finite() && acts.scale[2] > 0.0);
            assert!(acts.q[2 * BLOCK_WEIGHTS + 9] > 30_000);
            let mut x = vec![1.0f32; 2 * BLOCK_WEIGHTS];
            x[130] = f32::NAN;
            let err = quantize_acts(&x, 1, x.len(), isa).unwrap_err().to_string();
            assert!(err.contains("(0, 130)"), "{err}");
        }
    }
}

//! Activation quantization: f32 rows to int8 with one scale per 128 values (aligned with the weight
//! blocks), plus each block's sum, which the kernels share across all weight rows.
//!
//! Rules (every ISA gives the same bytes): `amax = max |x|` over the block, `scale = amax / 127`,
//! `q = round_half_even(x * (127 / amax))` clamped to ±127 (never -128, so negation cannot overflow);
//! an all-zero block has scale 0 and q = 0. Non-finite input is an error.

use super::block::BLOCK_WEIGHTS;
use super::Isa;
use crate::error::{Error, Result};

/// `n` rows of `k` activations quantized to int8, one scale and one sum per 128 values.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedActs {
    pub n: usize,
    pub k: usize,
    /// `n * k` int8 values, row-major.
    pub q: Vec<i8>,
    /// `n * k / 128` scales.
    pub scale: Vec<f32>,
    /// `n * k / 128` sums of the int8 values of each block.
    pub sum: Vec<i32>,
}

impl QuantizedActs {
    pub fn blocks_per_row(&self) -> usize {
        self.k / BLOCK_WEIGHTS
    }

    /// The int8 values of activation row `i`.
    pub fn row(&self, i: usize) -> &[i8] {
        &self.q[i * self.k..(i + 1) * self.k]
    }
}

/// Quantizes `n` rows of `k` f32 values (`k % 128 == 0`) with the kernel of `isa`.
pub fn quantize_acts(x: &[f32], n: usize, k: usize, isa: Isa) -> Result<QuantizedActs> {
    assert_eq!(x.len(), n * k);
    assert_eq!(k % BLOCK_WEIGHTS, 0);
    let blocks = n * k / BLOCK_WEIGHTS;
    let mut out = QuantizedActs { n, k, q: vec![0; n * k], scale: vec![0.0; blocks], sum: vec![0; blocks] };
    let chunks = x.chunks_exact(BLOCK_WEIGHTS).zip(out.q.chunks_exact_mut(BLOCK_WEIGHTS));
    for (i, (xb, qb)) in chunks.enumerate() {
        let amax = block_amax(xb, isa);
        if !amax.is_finite() {
            let bad = xb.iter().find(|v| !v.is_finite()).copied().unwrap_or(amax);
            let at = i * BLOCK_WEIGHTS + xb.iter().position(|v| !v.is_finite()).unwrap_or(0);
            return Err(Error::Value(format!("activations must be finite, found {bad} at ({}, {})", at / k, at % k)));
        }
        if amax > 0.0 {
            out.scale[i] = amax / 127.0;
            out.sum[i] = quantize_block(xb, 127.0 / amax, qb, isa);
        }
    }
    Ok(out)
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

fn quantize_block(xb: &[f32], inv: f32, qb: &mut [i8], isa: Isa) -> i32 {
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
        *q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
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
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        lanes.iter().fold(0.0f32, |a, &b| a.max(b))
    }

    /// Rounds `x * inv` half-to-even (the default MXCSR mode) into int8 and returns the block sum.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize_block(xb: &[f32], inv: f32, qb: &mut [i8]) -> i32 {
        let vinv = _mm256_set1_ps(inv);
        let lim = _mm256_set1_ps(127.0);
        let nlim = _mm256_set1_ps(-127.0);
        let mut sum = _mm256_setzero_si256();
        for (c, q) in xb.chunks_exact(32).zip(qb.chunks_exact_mut(32)) {
            let mut ints = [_mm256_setzero_si256(); 4];
            for (j, v) in ints.iter_mut().enumerate() {
                let x = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr().add(8 * j)), vinv);
                let x = _mm256_max_ps(_mm256_min_ps(_mm256_round_ps::<_MM_FROUND_TO_NEAREST_INT>(x), lim), nlim);
                *v = _mm256_cvtps_epi32(x);
                sum = _mm256_add_epi32(sum, *v);
            }
            // packs works per 128-bit lane; the permute restores element order.
            let w01 = _mm256_packs_epi32(ints[0], ints[1]);
            let w23 = _mm256_packs_epi32(ints[2], ints[3]);
            let b = _mm256_packs_epi16(w01, w23);
            let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr().cast(), b);
        }
        let mut lanes = [0i32; 8];
        _mm256_storeu_si256(lanes.as_mut_ptr().cast(), sum);
        lanes.iter().sum()
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

    /// Rounds `x * inv` half-to-even (`fcvtns`) into int8, saturating then clamping to -127, and
    /// returns the block sum.
    #[target_feature(enable = "neon")]
    pub unsafe fn quantize_block(xb: &[f32], inv: f32, qb: &mut [i8]) -> i32 {
        let lim = vdupq_n_s8(-127);
        // Per int16 lane: 8 chunks x 2 values x 127 at most.
        let mut sum = vdupq_n_s16(0);
        for (c, q) in xb.chunks_exact(16).zip(qb.chunks_exact_mut(16)) {
            let int = |k: usize| vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(c.as_ptr().add(4 * k)), inv));
            let lo = vqmovn_high_s32(vqmovn_s32(int(0)), int(1));
            let hi = vqmovn_high_s32(vqmovn_s32(int(2)), int(3));
            let b = vmaxq_s8(vqmovn_high_s16(vqmovn_s16(lo), hi), lim);
            vst1q_s8(q.as_mut_ptr(), b);
            sum = vpadalq_s8(sum, b);
        }
        vaddlvq_s16(sum)
    }
}

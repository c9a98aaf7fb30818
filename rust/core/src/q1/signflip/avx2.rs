//! AVX2 sign-flip block sum: sign bits to 16-bit lane masks, conditional negation with xor/sub, int16
//! adds, then `madd` against ones to 32-bit lanes.

use std::arch::x86_64::*;

use super::super::block::BlockQ1;

/// Expands 16 sign bits to 16 int16 lanes: all ones where the bit is clear (weight is -d), else 0.
#[inline(always)]
unsafe fn negate_mask(bits: u16) -> __m256i {
    let bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, i16::MIN);
    let spread = _mm256_set1_epi16(bits as i16);
    _mm256_cmpeq_epi16(_mm256_and_si256(spread, bit), _mm256_setzero_si256())
}

/// One row against int16 activations: `acc = fma(isum_b, d_w * d_a, acc)` over its blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn row_dot(row: &[BlockQ1], q: &[i16], scales: &[f32]) -> f32 {
    assert!(q.len() >= row.len() * 128 && scales.len() >= row.len());
    let mut acc = 0f32;
    for (b, block) in row.iter().enumerate() {
        let isum = block_sum(block, q.get_unchecked(b * 128..));
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes(block.d)))));
        acc = (isum as f32).mul_add(d * scales.get_unchecked(b), acc);
    }
    acc
}

/// Each int16 lane adds a subset of the block's signed values, so it never exceeds the block's L1
/// norm: no overflow.
#[inline(always)]
unsafe fn block_sum(block: &BlockQ1, q: &[i16]) -> i32 {
    let mut acc = _mm256_setzero_si256();
    for c in 0..8 {
        let bits = u16::from_le_bytes([block.qs[2 * c], block.qs[2 * c + 1]]);
        let m = negate_mask(bits);
        let x = _mm256_loadu_si256(q.as_ptr().add(16 * c).cast());
        acc = _mm256_add_epi16(acc, _mm256_sub_epi16(_mm256_xor_si256(x, m), m));
    }
    let wide = _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
    let s = _mm_add_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256::<1>(wide));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

//! AVX2 sign-flip block sum: sign bits to byte masks, conditional negation with xor/sub, then
//! `maddubs` against ones and `madd` to 32-bit lanes.

use std::arch::x86_64::*;

use super::super::block::BlockQ1;

/// Expands 32 sign bits to 32 bytes: 0xFF where the bit is clear (weight is -d), else 0.
#[inline(always)]
unsafe fn negate_mask(bits: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), _mm256_setzero_si256())
}

/// One row against int8 activations: `acc = fma(isum_b, d_w * d_a, acc)` over its blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn row_dot(row: &[BlockQ1], q: &[i8], scales: &[f32]) -> f32 {
    assert!(q.len() >= row.len() * 128 && scales.len() >= row.len());
    let mut acc = 0f32;
    for (b, block) in row.iter().enumerate() {
        let isum = block_sum(block, q.get_unchecked(b * 128..));
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes(block.d)))));
        acc = (isum as f32).mul_add(d * scales.get_unchecked(b), acc);
    }
    acc
}

#[inline(always)]
unsafe fn block_sum(block: &BlockQ1, q: &[i8]) -> i32 {
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_si256();
    for c in 0..4 {
        let bits = block.qs.as_ptr().add(4 * c).cast::<u32>().read_unaligned();
        let m = negate_mask(bits);
        let x = _mm256_loadu_si256(q.as_ptr().add(32 * c).cast());
        let flipped = _mm256_sub_epi8(_mm256_xor_si256(x, m), m);
        let pairs = _mm256_maddubs_epi16(ones8, flipped);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones16));
    }
    let s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256::<1>(acc));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

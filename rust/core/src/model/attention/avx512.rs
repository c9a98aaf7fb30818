//! The AVX-512 group kernel for f16 and int8 KV: the query heads of one KV head, two at a time, share
//! every load and widening of their keys and values. Scores of a block of 16 keys accumulate in four
//! partial sums per head (dimensions `d % 4`), so the multiply-adds are not one latency chain (times
//! the keys' row scales for int8); a head's output (head dim 64 or 128: 4 or 8 zmm registers) stays
//! in registers over all positions (each weight times its value's row scale for int8) and is divided
//! by the softmax total once at the end: the per-head loop's arithmetic bit for bit.
//!
//! int8 KV went through the AVX2 kernel before, which one Zen 4 core ran at 2.72-2.76 ms a token at
//! 512 positions (`examples/attention_speed`, 28 layers); here, with the piece three blocks ahead
//! asked for ([`super::x86::AHEAD`]), 1.71-1.81 (f16: 3.15-3.21 before, 2.49-2.65 now).

use std::arch::x86_64::*;

use super::x86::{ahead, prefetch_l2 as prefetch, prefetch_scales, AHEAD};
use super::{softmax_unnormalized, Head, BLOCK_TOKENS};
use crate::kv::{KvElem, F16, I8};
use crate::q1::Isa;

/// A KV element type whose 16 consecutive values widen to one 16-lane f32 vector.
pub trait Widen16: KvElem {
    /// The 16 values at `at`, widened exactly.
    ///
    /// # Safety
    /// 16 values from `at` must be readable; the CPU must support AVX-512 F and F16C.
    unsafe fn load16(at: *const Self) -> __m512;
}

impl Widen16 for F16 {
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16(at: *const F16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i))
    }
}

impl Widen16 for I8 {
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16(at: *const I8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at as *const __m128i)))
    }
}

/// Runs `head`'s group on this kernel and returns true, or returns false (nothing written) when the
/// CPU lacks AVX-512 F + F16C + FMA or the head dimension is not 64 or 128.
pub fn attend_group<E: Widen16>(head: &Head<E>, out: &mut [f32]) -> bool {
    if !has_avx512() {
        return false;
    }
    // SAFETY: the CPU supports AVX-512 F, F16C and FMA (checked just above).
    match head.cache.layout().head_dim {
        64 => unsafe { group::<E, 4>(head, out) },
        128 => unsafe { group::<E, 8>(head, out) },
        _ => return false,
    }
    true
}

/// AVX-512 F/BW/VL with AVX2, FMA and F16C, unless `OXIBONSAI_ISA` asks for less ([`Isa::detect`]).
fn has_avx512() -> bool {
    Isa::detect().has_avx512()
}

/// Every query head of the group, two at a time (`C` = head_dim / 16).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn group<E: Widen16, const C: usize>(head: &Head<E>, out: &mut [f32]) {
    let d = 16 * C;
    assert_eq!(head.q.len(), out.len());
    for (q, o) in head.q.chunks(2 * d).zip(out.chunks_mut(2 * d)) {
        if q.len() == 2 * d {
            heads::<E, C, 2>(head, [&q[..d], &q[d..]], o);
        } else {
            heads::<E, C, 1>(head, [q], o);
        }
    }
}

/// Attention of `H` query heads (1 or 2) over the KV head of `head`; `out` is `H` rows of `16 C`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn heads<E: Widen16, const C: usize, const H: usize>(head: &Head<E>, q: [&[f32]; H], out: &mut [f32]) {
    let (cache, layer, kv_head) = (head.cache, head.layer, head.kv_head);
    let seen = head.slot.pos + 1;
    let blocks = &head.slot.block_table[..seen.div_ceil(BLOCK_TOKENS)];
    let mut scores: [Vec<f32>; H] = std::array::from_fn(|_| Vec::with_capacity(blocks.len() * BLOCK_TOKENS));
    for i in 0..AHEAD {
        if let Some(piece) = ahead(head, blocks, i) {
            prefetch(piece);
        }
        prefetch_scales(head, blocks, i);
    }
    for (b, &block) in blocks.iter().enumerate() {
        let keys = cache.keys(layer, block as usize, kv_head);
        // Later keys (or the first values) stream in while this block is scored.
        let next = ahead(head, blocks, b + AHEAD);
        prefetch_scales(head, blocks, b + AHEAD);
        let k_scales = cache.key_scales(layer, block as usize, kv_head);
        let block_scores = score_block::<E, C, H>(&q, keys, k_scales, next, head.scale);
        for (s, b) in scores.iter_mut().zip(&block_scores) {
            s.extend_from_slice(b);
        }
    }
    let totals: [f32; H] = std::array::from_fn(|h| softmax_unnormalized(&mut scores[h][..seen]));
    let mut acc = [[_mm512_setzero_ps(); C]; H];
    for (b, &block) in blocks.iter().enumerate() {
        let values = cache.values(layer, block as usize, kv_head);
        let v_scales = cache.value_scales(layer, block as usize, kv_head);
        let next = ahead(head, blocks, blocks.len() + b + AHEAD);
        let used = (seen - b * BLOCK_TOKENS).min(BLOCK_TOKENS);
        for (slot, v) in values.chunks_exact(16 * C).take(used).enumerate() {
            if let Some(next) = next {
                prefetch(&next[slot * 16 * C..(slot + 1) * 16 * C]);
            }
            let w: [f32; H] = std::array::from_fn(|h| {
                let w = scores[h][b * BLOCK_TOKENS + slot];
                if E::SCALED {
                    w * v_scales[slot]
                } else {
                    w
                }
            });
            add_value::<E, C, H>(&mut acc, w, v);
        }
    }
    for (h, row) in out.chunks_exact_mut(16 * C).enumerate() {
        let inv = _mm512_set1_ps(1.0 / totals[h]);
        for (c, a) in acc[h].iter().enumerate() {
            // SAFETY: `row` holds 16 C floats.
            _mm512_storeu_ps(row.as_mut_ptr().add(16 * c), _mm512_mul_ps(*a, inv));
        }
    }
}

/// `q_h . k_j * scale` for the 16 keys of one block (stored `[dim][slot]`) and each head (the sums
/// times `k_scales` first for a scaled type); prefetches `next` (a piece as long as `keys`) meanwhile.
#[inline(always)]
unsafe fn score_block<E: Widen16, const C: usize, const H: usize>(
    q: &[&[f32]; H],
    keys: &[E],
    k_scales: &[f32; BLOCK_TOKENS],
    next: Option<&[E]>,
    scale: f32,
) -> [[f32; BLOCK_TOKENS]; H] {
    let d = 16 * C;
    assert!(keys.len() >= d * BLOCK_TOKENS && q.iter().all(|q| q.len() == d));
    let mut acc = [[_mm512_setzero_ps(); 4]; H];
    for dim in (0..d).step_by(4) {
        // Four rows of 16 values: two cache lines of halves, one of int8.
        if let Some(next) = next {
            prefetch(&next[dim * BLOCK_TOKENS..(dim + 4) * BLOCK_TOKENS]);
        }
        for lane in 0..4 {
            // SAFETY: row `dim + lane` of 16 values is inside `keys` (asserted above).
            let k = E::load16(keys.as_ptr().add((dim + lane) * BLOCK_TOKENS));
            for h in 0..H {
                acc[h][lane] = _mm512_fmadd_ps(_mm512_set1_ps(q[h][dim + lane]), k, acc[h][lane]);
            }
        }
    }
    let s = _mm512_set1_ps(scale);
    let k_scale = _mm512_loadu_ps(k_scales.as_ptr());
    std::array::from_fn(|h| {
        let [a, b, c, e] = acc[h];
        let mut sum = _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, e));
        if E::SCALED {
            sum = _mm512_mul_ps(sum, k_scale);
        }
        let mut row = [0.0f32; BLOCK_TOKENS];
        // SAFETY: `row` holds 16 floats.
        _mm512_storeu_ps(row.as_mut_ptr(), _mm512_mul_ps(sum, s));
        row
    })
}

/// `acc_h += w_h * v` for one value row of `16 C` values.
#[inline(always)]
unsafe fn add_value<E: Widen16, const C: usize, const H: usize>(acc: &mut [[__m512; C]; H], w: [f32; H], v: &[E]) {
    assert!(v.len() >= 16 * C);
    let wv: [__m512; H] = std::array::from_fn(|h| _mm512_set1_ps(w[h]));
    for c in 0..C {
        // SAFETY: values `16 c .. 16 c + 16` are inside `v` (asserted above).
        let x = E::load16(v.as_ptr().add(16 * c));
        for (acc_h, w_h) in acc.iter_mut().zip(&wv) {
            acc_h[c] = _mm512_fmadd_ps(*w_h, x, acc_h[c]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::reversed_cache;
    use super::super::TokenSlot;
    use super::*;

    #[test]
    fn other_head_dims_are_declined() {
        let cache = reversed_cache::<F16>(3, 32, 1);
        let table = [0u32];
        let slot = TokenSlot { pos: 2, block_table: &table };
        let q = vec![0.5; 32];
        let head = Head { layer: 1, kv_head: 0, q: &q, slot: &slot, scale: 0.1, cache: &cache };
        let mut out = vec![7.0; 32];
        assert!(!attend_group(&head, &mut out));
        assert!(out.iter().all(|&x| x == 7.0));
    }
}

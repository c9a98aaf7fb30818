//! The AVX-512 group kernel for f16 KV: the query heads of one KV head, two at a time, share every
//! load and widening of their keys and values. Scores of a block of 16 keys accumulate in four
//! partial sums per head (dimensions `d % 4`), so the multiply-adds are not one latency chain; a
//! head's output (head dim 64 or 128: 4 or 8 zmm registers) stays in registers over all positions
//! and is divided by the softmax total once at the end.

use std::arch::x86_64::*;

use super::x86::prefetch_l2 as prefetch;
use super::{softmax_unnormalized, Head, BLOCK_TOKENS};
use crate::kv::F16;
use crate::q1::Isa;

/// Runs `head`'s group on this kernel and returns true, or returns false (nothing written) when the
/// CPU lacks AVX-512 F + F16C + FMA or the head dimension is not 64 or 128.
pub fn attend_group(head: &Head<F16>, out: &mut [f32]) -> bool {
    if !has_avx512() {
        return false;
    }
    // SAFETY: the CPU supports AVX-512 F, F16C and FMA (checked just above).
    match head.cache.layout().head_dim {
        64 => unsafe { group::<4>(head, out) },
        128 => unsafe { group::<8>(head, out) },
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
unsafe fn group<const C: usize>(head: &Head<F16>, out: &mut [f32]) {
    let d = 16 * C;
    assert_eq!(head.q.len(), out.len());
    for (q, o) in head.q.chunks(2 * d).zip(out.chunks_mut(2 * d)) {
        if q.len() == 2 * d {
            heads::<C, 2>(head, [&q[..d], &q[d..]], o);
        } else {
            heads::<C, 1>(head, [q], o);
        }
    }
}

/// Attention of `H` query heads (1 or 2) over the KV head of `head`; `out` is `H` rows of `16 C`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn heads<const C: usize, const H: usize>(head: &Head<F16>, q: [&[f32]; H], out: &mut [f32]) {
    let seen = head.slot.pos + 1;
    let blocks = &head.slot.block_table[..seen.div_ceil(BLOCK_TOKENS)];
    let mut scores: [Vec<f32>; H] = std::array::from_fn(|_| Vec::with_capacity(blocks.len() * BLOCK_TOKENS));
    for (b, &block) in blocks.iter().enumerate() {
        let keys = head.cache.keys(head.layer, block as usize, head.kv_head);
        // The next block's keys (or the first block's values) stream in while this block is scored.
        let next = match blocks.get(b + 1) {
            Some(&n) => head.cache.keys(head.layer, n as usize, head.kv_head),
            None => head.cache.values(head.layer, blocks[0] as usize, head.kv_head),
        };
        let block_scores = score_block::<C, H>(&q, keys, next, head.scale);
        for (s, b) in scores.iter_mut().zip(&block_scores) {
            s.extend_from_slice(b);
        }
    }
    let totals: [f32; H] = std::array::from_fn(|h| softmax_unnormalized(&mut scores[h][..seen]));
    let mut acc = [[_mm512_setzero_ps(); C]; H];
    for (b, &block) in blocks.iter().enumerate() {
        let values = head.cache.values(head.layer, block as usize, head.kv_head);
        let next = blocks.get(b + 1).map(|&n| head.cache.values(head.layer, n as usize, head.kv_head));
        let used = (seen - b * BLOCK_TOKENS).min(BLOCK_TOKENS);
        for (slot, v) in values.chunks_exact(16 * C).take(used).enumerate() {
            if let Some(next) = next {
                prefetch(&next[slot * 16 * C..(slot + 1) * 16 * C]);
            }
            let w: [f32; H] = std::array::from_fn(|h| scores[h][b * BLOCK_TOKENS + slot]);
            add_value::<C, H>(&mut acc, w, v);
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

/// `q_h . k_j * scale` for the 16 keys of one block (stored `[dim][slot]`) and each head; prefetches
/// `next` (as many bytes as `keys`) along the way.
#[inline(always)]
unsafe fn score_block<const C: usize, const H: usize>(
    q: &[&[f32]; H],
    keys: &[F16],
    next: &[F16],
    scale: f32,
) -> [[f32; BLOCK_TOKENS]; H] {
    let d = 16 * C;
    assert!(keys.len() >= d * BLOCK_TOKENS && q.iter().all(|q| q.len() == d));
    let mut acc = [[_mm512_setzero_ps(); 4]; H];
    for dim in (0..d).step_by(4) {
        // Four rows of 16 halves: two cache lines.
        prefetch(&next[dim * BLOCK_TOKENS..(dim + 4) * BLOCK_TOKENS]);
        for lane in 0..4 {
            // SAFETY: row `dim + lane` of 16 halves is inside `keys` (asserted above).
            let row = keys.as_ptr().add((dim + lane) * BLOCK_TOKENS) as *const __m256i;
            let k = _mm512_cvtph_ps(_mm256_loadu_si256(row));
            for h in 0..H {
                acc[h][lane] = _mm512_fmadd_ps(_mm512_set1_ps(q[h][dim + lane]), k, acc[h][lane]);
            }
        }
    }
    let s = _mm512_set1_ps(scale);
    std::array::from_fn(|h| {
        let [a, b, c, e] = acc[h];
        let sum = _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, e));
        let mut row = [0.0f32; BLOCK_TOKENS];
        // SAFETY: `row` holds 16 floats.
        _mm512_storeu_ps(row.as_mut_ptr(), _mm512_mul_ps(sum, s));
        row
    })
}

/// `acc_h += w_h * v` for one value row of `16 C` halves.
#[inline(always)]
unsafe fn add_value<const C: usize, const H: usize>(acc: &mut [[__m512; C]; H], w: [f32; H], v: &[F16]) {
    assert!(v.len() >= 16 * C);
    let wv: [__m512; H] = std::array::from_fn(|h| _mm512_set1_ps(w[h]));
    for c in 0..C {
        // SAFETY: halves `16 c .. 16 c + 16` are inside `v` (asserted above).
        let x = _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(16 * c) as *const __m256i));
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
        let cache = reversed_cache(3, 32, 1);
        let table = [0u32];
        let slot = TokenSlot { pos: 2, block_table: &table };
        let q = vec![0.5; 32];
        let head = Head { layer: 1, kv_head: 0, q: &q, slot: &slot, scale: 0.1, cache: &cache };
        let mut out = vec![7.0; 32];
        assert!(!attend_group(&head, &mut out));
        assert!(out.iter().all(|&x| x == 7.0));
    }
}

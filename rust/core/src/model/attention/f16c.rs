//! The AVX2 + FMA + F16C group kernel for f16 KV, for CPUs without AVX-512: the query heads of one KV
//! head, two at a time, share every load and widening of their keys and values, and the next block's
//! keys or values are asked into L2 a line at a time while a block is worked on (a block's 4 KiB
//! pieces are scattered by the block table). Per head it does the per-head loop's arithmetic (the
//! module doc of [`super`]) bit for bit: keys 0..8 and then 8..16 of a block in four partial sums
//! each, the softmax, `out = fma(w, v, out)`, times `1 / total` at the end.
//!
//! Measured on one Zen 4 core (`examples/attention_speed`, the AVX-512 kernel switched off by a
//! throwaway knob): 16.8-17.0 GB/s of keys and values at 512 positions and 16.0-16.3 at 2048, where
//! the per-head loop it replaces read 7.4-7.6 and 6.9-7.2 (each block once per query head, no
//! prefetch), and the AVX-512 group kernel 17.4-18.5 and 16.3-16.6.

use std::arch::x86_64::*;

use super::x86::prefetch_l2 as prefetch;
use super::{softmax_unnormalized, Head, BLOCK_TOKENS};
use crate::kv::elem::widen;
use crate::kv::F16;
use crate::q1::Isa;

/// Whether the CPU has what [`attend_group`] needs (and `OXIBONSAI_ISA` does not ask for scalar code:
/// [`Isa::detect`]).
pub fn available() -> bool {
    Isa::detect().has_avx2()
}

/// Every query head of `head`'s group, two at a time, into `out` (one row of `head_dim` per head).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_group(head: &Head<F16>, out: &mut [f32]) {
    let d = head.cache.layout().head_dim;
    assert_eq!(head.q.len(), out.len());
    for (q, o) in head.q.chunks(2 * d).zip(out.chunks_mut(2 * d)) {
        if q.len() == 2 * d {
            heads::<2>(head, [&q[..d], &q[d..]], o);
        } else {
            heads::<1>(head, [q], o);
        }
    }
}

/// Attention of `H` query heads (1 or 2) over the KV head of `head`; `out` is `H` rows of `head_dim`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn heads<const H: usize>(head: &Head<F16>, q: [&[f32]; H], out: &mut [f32]) {
    let (cache, layer, kv_head) = (head.cache, head.layer, head.kv_head);
    let d = q[0].len();
    let seen = head.slot.pos + 1;
    let blocks = &head.slot.block_table[..seen.div_ceil(BLOCK_TOKENS)];
    let mut scores: [Vec<f32>; H] = std::array::from_fn(|_| Vec::with_capacity(blocks.len() * BLOCK_TOKENS));
    for (b, &block) in blocks.iter().enumerate() {
        // The next block's keys (or after the last one the first block's values) stream in meanwhile.
        let next = match blocks.get(b + 1) {
            Some(&next) => cache.keys(layer, next as usize, kv_head),
            None => cache.values(layer, blocks[0] as usize, kv_head),
        };
        let used = (seen - b * BLOCK_TOKENS).min(BLOCK_TOKENS);
        let block_scores = score_block::<H>(&q, cache.keys(layer, block as usize, kv_head), next, head.scale);
        for (s, row) in scores.iter_mut().zip(&block_scores) {
            s.extend_from_slice(&row[..used]);
        }
    }
    let totals: [f32; H] = std::array::from_fn(|h| softmax_unnormalized(&mut scores[h]));
    out.fill(0.0);
    for (b, &block) in blocks.iter().enumerate() {
        let next = blocks.get(b + 1).map(|&n| cache.values(layer, n as usize, kv_head));
        let values = cache.values(layer, block as usize, kv_head);
        let used = (seen - b * BLOCK_TOKENS).min(BLOCK_TOKENS);
        for (slot, v) in values.chunks_exact(d).take(used).enumerate() {
            if let Some(next) = next {
                prefetch(&next[slot * d..(slot + 1) * d]);
            }
            let w: [f32; H] = std::array::from_fn(|h| scores[h][b * BLOCK_TOKENS + slot]);
            add_value::<H>(out, w, v);
        }
    }
    for (row, total) in out.chunks_exact_mut(d).zip(totals) {
        let inverse = 1.0 / total;
        row.iter_mut().for_each(|o| *o *= inverse);
    }
}

/// `q_h . k_j * scale` for the 16 keys of one block (stored `[dim][slot]`) and each head: keys 0..8,
/// then keys 8..16, each in four partial sums (dimension `d % 4`) over the dimensions in order, added
/// as `(s0 + s1) + (s2 + s3)`. Prefetches `next` (as many bytes as `keys`) in the first pass, a line
/// every second dimension.
#[inline(always)]
unsafe fn score_block<const H: usize>(
    q: &[&[f32]; H],
    keys: &[F16],
    next: &[F16],
    scale: f32,
) -> [[f32; BLOCK_TOKENS]; H] {
    let d = q[0].len();
    assert!(keys.len() >= d * BLOCK_TOKENS && next.len() >= d * BLOCK_TOKENS && q.iter().all(|q| q.len() == d));
    let s = _mm256_set1_ps(scale);
    let mut rows = [[0.0f32; BLOCK_TOKENS]; H];
    for half in 0..2 {
        let mut acc = [[_mm256_setzero_ps(); 4]; H];
        let whole = d / 4 * 4;
        for dim in (0..whole).step_by(4) {
            if half == 0 {
                prefetch(&next[dim * BLOCK_TOKENS..(dim + 4) * BLOCK_TOKENS]);
            }
            add_keys::<H, 4>(&mut acc, q, keys, dim, half);
        }
        match d - whole {
            1 => add_keys::<H, 1>(&mut acc, q, keys, whole, half),
            2 => add_keys::<H, 2>(&mut acc, q, keys, whole, half),
            3 => add_keys::<H, 3>(&mut acc, q, keys, whole, half),
            _ => {}
        }
        if half == 0 && d > whole {
            prefetch(&next[whole * BLOCK_TOKENS..d * BLOCK_TOKENS]);
        }
        for (row, [a, b, c, e]) in rows.iter_mut().zip(acc) {
            let sum = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, e));
            // SAFETY: `row` holds 16 floats; this half's 8 start at `8 * half`.
            _mm256_storeu_ps(row.as_mut_ptr().add(8 * half), _mm256_mul_ps(sum, s));
        }
    }
    rows
}

/// Dimensions `dim .. dim + L` (`L` at most 4, `dim` a multiple of 4) of keys `8 half .. 8 half + 8`
/// into partial sums `0 .. L`, for each head.
///
/// # Safety
/// Rows `dim .. dim + L` of 16 halves must be inside `keys`, and `dim + L` at most each `q`'s length
/// (`score_block` asserts both for all dimensions once).
#[inline(always)]
unsafe fn add_keys<const H: usize, const L: usize>(
    acc: &mut [[__m256; 4]; H],
    q: &[&[f32]; H],
    keys: &[F16],
    dim: usize,
    half: usize,
) {
    for lane in 0..L {
        // SAFETY: row `dim + lane` is inside `keys` (the caller's promise); this half is its 8
        // halves from `8 half`.
        let row = keys.as_ptr().add((dim + lane) * BLOCK_TOKENS + 8 * half) as *const __m128i;
        let k = _mm256_cvtph_ps(_mm_loadu_si128(row));
        for (acc_h, q_h) in acc.iter_mut().zip(q) {
            let qd = _mm256_set1_ps(*q_h.get_unchecked(dim + lane));
            acc_h[lane] = _mm256_fmadd_ps(qd, k, acc_h[lane]);
        }
    }
}

/// `out_h += w_h * v` for one value row (`out`: `H` rows of `v.len()`), `v` widened once for all heads.
#[inline(always)]
unsafe fn add_value<const H: usize>(out: &mut [f32], w: [f32; H], v: &[F16]) {
    let d = v.len();
    assert_eq!(out.len(), H * d);
    let wv: [__m256; H] = std::array::from_fn(|h| _mm256_set1_ps(w[h]));
    let whole = d / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: `i + 8 <= whole <= d`, inside `v` and inside each of `out`'s rows (asserted above).
        let x = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i));
        for (h, w) in wv.iter().enumerate() {
            let o = out.as_mut_ptr().add(h * d + i);
            _mm256_storeu_ps(o, _mm256_fmadd_ps(*w, x, _mm256_loadu_ps(o)));
        }
    }
    for (h, row) in out.chunks_exact_mut(d).enumerate() {
        for (o, x) in row[whole..].iter_mut().zip(&v[whole..]) {
            *o = w[h].mul_add(widen(*x), *o);
        }
    }
}

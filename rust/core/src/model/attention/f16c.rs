//! The AVX2 + FMA + F16C group kernel for f16 and int8 KV on CPUs without AVX-512 (and at head dims
//! the AVX-512 kernel declines): the query heads of one KV head, two at a time, share every load and
//! widening of their keys and values, and the keys or values three blocks on are asked into L2 a line
//! at a time while a block is worked on (a block's pieces are scattered by the block table). Per head it does
//! the per-head loop's arithmetic (the module doc of [`super`]) bit for bit: keys 0..8 and then 8..16
//! of a block in four partial sums each (times the keys' row scales for int8), the softmax,
//! `out = fma(w, v, out)` (`w` times the value's row scale for int8), times `1 / total` at the end.
//!
//! Measured on one Zen 4 core (`examples/attention_speed`, the AVX-512 kernel switched off by a
//! throwaway knob): 16.8-17.0 GB/s of keys and values at 512 positions and 16.0-16.3 at 2048, where
//! the per-head loop it replaces read 7.4-7.6 and 6.9-7.2 (each block once per query head, no
//! prefetch), and the AVX-512 group kernel 17.4-18.5 and 16.3-16.6.
//! On a 2-core AMD EPYC without AVX-512 (28 layers at 4,096 positions, two threads): f16 32.6-33.2 ms
//! a token, int8 18.7-19.4 ms, where int8 through the per-head loop took 35.6-38.3 and through this
//! kernel adding value rows one by one (loading and storing the sums each row) 28.6-28.9.

use std::arch::x86_64::*;

use super::x86::{ahead, prefetch_l2 as prefetch, prefetch_scales, AHEAD};
use super::{softmax_unnormalized, Head, BLOCK_TOKENS};
use crate::kv::{KvElem, F16, I8};
use crate::q1::Isa;

/// A KV element type whose 8 consecutive values widen to one 8-lane f32 vector.
pub trait Widen8: KvElem {
    /// The 8 values at `at`, widened exactly.
    ///
    /// # Safety
    /// 8 values from `at` must be readable; the CPU must support AVX2 and F16C.
    unsafe fn load8(at: *const Self) -> __m256;
}

impl Widen8 for F16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(at: *const F16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
    }
}

impl Widen8 for I8 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(at: *const I8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(at as *const __m128i)))
    }
}

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
pub unsafe fn attend_group<E: Widen8>(head: &Head<E>, out: &mut [f32]) {
    let d = head.cache.layout().head_dim;
    assert_eq!(head.q.len(), out.len());
    for (q, o) in head.q.chunks(2 * d).zip(out.chunks_mut(2 * d)) {
        if q.len() == 2 * d {
            heads::<E, 2>(head, [&q[..d], &q[d..]], o);
        } else {
            heads::<E, 1>(head, [q], o);
        }
    }
}

/// Attention of `H` query heads (1 or 2) over the KV head of `head`; `out` is `H` rows of `head_dim`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn heads<E: Widen8, const H: usize>(head: &Head<E>, q: [&[f32]; H], out: &mut [f32]) {
    let (cache, layer, kv_head) = (head.cache, head.layer, head.kv_head);
    let d = q[0].len();
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
        // Later keys (or after the last ones the first values) stream in meanwhile.
        let next = ahead(head, blocks, b + AHEAD);
        prefetch_scales(head, blocks, b + AHEAD);
        let used = (seen - b * BLOCK_TOKENS).min(BLOCK_TOKENS);
        let keys = cache.keys(layer, block as usize, kv_head);
        let k_scales = cache.key_scales(layer, block as usize, kv_head);
        let block_scores = score_block::<E, H>(&q, keys, k_scales, next, head.scale);
        for (s, row) in scores.iter_mut().zip(&block_scores) {
            s.extend_from_slice(&row[..used]);
        }
    }
    let totals: [f32; H] = std::array::from_fn(|h| softmax_unnormalized(&mut scores[h]));
    out.fill(0.0);
    for (b, &block) in blocks.iter().enumerate() {
        let next = ahead(head, blocks, blocks.len() + b + AHEAD);
        let values = cache.values(layer, block as usize, kv_head);
        let v_scales = cache.value_scales(layer, block as usize, kv_head);
        let used = (seen - b * BLOCK_TOKENS).min(BLOCK_TOKENS);
        let w: [[f32; BLOCK_TOKENS]; H] = std::array::from_fn(|h| {
            std::array::from_fn(|slot| {
                let w = scores[h].get(b * BLOCK_TOKENS + slot).copied().unwrap_or(0.0);
                if E::SCALED {
                    w * v_scales[slot]
                } else {
                    w
                }
            })
        });
        add_values::<E, H>(out, &w, &values[..used * d], next);
    }
    for (row, total) in out.chunks_exact_mut(d).zip(totals) {
        let inverse = 1.0 / total;
        row.iter_mut().for_each(|o| *o *= inverse);
    }
}

/// `q_h . k_j * scale` for the 16 keys of one block (stored `[dim][slot]`) and each head: keys 0..8,
/// then keys 8..16, each in four partial sums (dimension `d % 4`) over the dimensions in order, added
/// as `(s0 + s1) + (s2 + s3)` (times `k_scales` first for a scaled type). Prefetches `next` (a piece
/// as long as `keys`) in the first pass.
#[inline(always)]
unsafe fn score_block<E: Widen8, const H: usize>(
    q: &[&[f32]; H],
    keys: &[E],
    k_scales: &[f32; BLOCK_TOKENS],
    next: Option<&[E]>,
    scale: f32,
) -> [[f32; BLOCK_TOKENS]; H] {
    let d = q[0].len();
    assert!(keys.len() >= d * BLOCK_TOKENS && q.iter().all(|q| q.len() == d));
    let s = _mm256_set1_ps(scale);
    let mut rows = [[0.0f32; BLOCK_TOKENS]; H];
    for half in 0..2 {
        let mut acc = [[_mm256_setzero_ps(); 4]; H];
        let whole = d / 4 * 4;
        for dim in (0..whole).step_by(4) {
            if let (0, Some(next)) = (half, next) {
                prefetch(&next[dim * BLOCK_TOKENS..(dim + 4) * BLOCK_TOKENS]);
            }
            add_keys::<E, H, 4>(&mut acc, q, keys, dim, half);
        }
        match d - whole {
            1 => add_keys::<E, H, 1>(&mut acc, q, keys, whole, half),
            2 => add_keys::<E, H, 2>(&mut acc, q, keys, whole, half),
            3 => add_keys::<E, H, 3>(&mut acc, q, keys, whole, half),
            _ => {}
        }
        if let (0, Some(next), true) = (half, next, d > whole) {
            prefetch(&next[whole * BLOCK_TOKENS..d * BLOCK_TOKENS]);
        }
        // SAFETY: `k_scales` holds 16 floats; this half's 8 start at `8 * half`.
        let k_scale = _mm256_loadu_ps(k_scales.as_ptr().add(8 * half));
        for (row, [a, b, c, e]) in rows.iter_mut().zip(acc) {
            let mut sum = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, e));
            if E::SCALED {
                sum = _mm256_mul_ps(sum, k_scale);
            }
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
unsafe fn add_keys<E: Widen8, const H: usize, const L: usize>(
    acc: &mut [[__m256; 4]; H],
    q: &[&[f32]; H],
    keys: &[E],
    dim: usize,
    half: usize,
) {
    for lane in 0..L {
        // SAFETY: row `dim + lane` is inside `keys` (the caller's promise); this half is its 8
        // values from `8 half`.
        let k = E::load8(keys.as_ptr().add((dim + lane) * BLOCK_TOKENS + 8 * half));
        for (acc_h, q_h) in acc.iter_mut().zip(q) {
            let qd = _mm256_set1_ps(*q_h.get_unchecked(dim + lane));
            acc_h[lane] = _mm256_fmadd_ps(qd, k, acc_h[lane]);
        }
    }
}

/// `out_h += w_h[j] * v_j` for the value rows `v_j` of one block (`values`: `used` rows of
/// `head_dim`; `out`: `H` rows of `head_dim`), each output element over the rows in order, so the
/// bits are those of adding row after row. Dimensions go 32 at a time, their `H x 4` sums held in
/// registers over the block's rows (one load and store of `out` per block, not per row), each row
/// widened once for all heads; `next` (the next block's values) is asked into L2 meanwhile.
#[inline(always)]
unsafe fn add_values<E: Widen8, const H: usize>(
    out: &mut [f32],
    w: &[[f32; BLOCK_TOKENS]; H],
    values: &[E],
    next: Option<&[E]>,
) {
    let d = out.len() / H;
    let used = values.len() / d;
    assert!(out.len() == H * d && values.len() == used * d && used <= BLOCK_TOKENS);
    let wide = d / 32 * 32;
    for dim in (0..wide).step_by(32) {
        // SAFETY: `dim + 32 <= wide <= d`: inside each of `out`'s rows (asserted above).
        let mut acc: [[__m256; 4]; H] =
            std::array::from_fn(|h| std::array::from_fn(|i| _mm256_loadu_ps(out.as_ptr().add(h * d + dim + 8 * i))));
        for slot in 0..used {
            if let (0, Some(next)) = (dim, next) {
                prefetch(&next[slot * d..(slot + 1) * d]);
            }
            let wv: [__m256; H] = std::array::from_fn(|h| _mm256_set1_ps(w[h][slot]));
            for (i, lanes) in (0..4).map(|i| (i, dim + 8 * i)) {
                // SAFETY: `lanes + 8 <= d`: inside row `slot` of `values`.
                let x = E::load8(values.as_ptr().add(slot * d + lanes));
                for h in 0..H {
                    acc[h][i] = _mm256_fmadd_ps(wv[h], x, acc[h][i]);
                }
            }
        }
        for (h, sums) in acc.iter().enumerate() {
            for (i, sum) in sums.iter().enumerate() {
                // SAFETY: as for the loads above.
                _mm256_storeu_ps(out.as_mut_ptr().add(h * d + dim + 8 * i), *sum);
            }
        }
    }
    if wide < d {
        for (slot, v) in values.chunks_exact(d).enumerate() {
            if let (0, Some(next)) = (wide, next) {
                prefetch(&next[slot * d..(slot + 1) * d]);
            }
            let w_slot: [f32; H] = std::array::from_fn(|h| w[h][slot]);
            add_value_tail::<E, H>(out, w_slot, v, wide);
        }
    }
}

/// `out_h[i] += w_h * v[i]` for dimensions `from..` of one value row (`out`: `H` rows of `v.len()`).
#[inline(always)]
unsafe fn add_value_tail<E: Widen8, const H: usize>(out: &mut [f32], w: [f32; H], v: &[E], from: usize) {
    let d = v.len();
    assert_eq!(out.len(), H * d);
    let wv: [__m256; H] = std::array::from_fn(|h| _mm256_set1_ps(w[h]));
    let whole = from + (d - from) / 8 * 8;
    for i in (from..whole).step_by(8) {
        // SAFETY: `i + 8 <= whole <= d`, inside `v` and inside each of `out`'s rows (asserted above).
        let x = E::load8(v.as_ptr().add(i));
        for (h, w) in wv.iter().enumerate() {
            let o = out.as_mut_ptr().add(h * d + i);
            _mm256_storeu_ps(o, _mm256_fmadd_ps(*w, x, _mm256_loadu_ps(o)));
        }
    }
    for (h, row) in out.chunks_exact_mut(d).enumerate() {
        for (o, x) in row[whole..].iter_mut().zip(&v[whole..]) {
            *o = w[h].mul_add(x.to_f32(), *o);
        }
    }
}

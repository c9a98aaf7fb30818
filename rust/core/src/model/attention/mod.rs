//! Grouped-query causal attention of a batch of tokens over the paged KV cache. Each (token, KV head)
//! pair -- the query heads sharing that KV head -- is computed alone, reading keys and values through
//! its sequence's block table, so a token's output is the same whether it ran in a prefill batch or
//! alone in a decode step, and with any thread count. With f16 or int8 KV on x86-64 the query heads of
//! a group share one read of their keys and values ([`avx512`] with AVX-512 at head dim 64 or 128,
//! else [`f16c`] with AVX2 + F16C); elsewhere (f32 KV, other CPUs) each query head runs the per-head
//! loop below.
//!
//! Every build does the same arithmetic, so a token's output has the same bits on every instruction
//! set and CPU (the per-head loop is its definition): a block's 16 scores are `q . k_j` in four
//! partial sums of fused multiply-adds (dimensions `d % 4`, each in dimension order), added as
//! `(s0 + s1) + (s2 + s3)`, times the scale; the softmax of [`softmax_unnormalized`]; the output is
//! `fma(w_j, v_j, acc)` over the positions in order with the unnormalized weights, times
//! `1 / total` at the end. With int8 KV (integers over one scale per token and head) the sums are of
//! the stored integers, times the key's scale before the score's; `w_j` is times the value's scale.

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod f16c;

use crate::fused::{MulAdd, Portable};
use crate::kv::{KvCache, KvElem, BLOCK_TOKENS, F16, I8};
use crate::pool::Pool;
use crate::sample::math::exp_nonpositive;

/// Where one batch token sits: its position and its sequence's block table.
pub struct TokenSlot<'a> {
    pub pos: usize,
    pub block_table: &'a [u32],
}

/// The attention shape.
pub struct AttentionShape {
    pub n_heads: usize,
    pub group: usize,
    pub head_dim: usize,
}

/// One token's query heads over one KV head (`q`: one or more heads of `head_dim`): where their keys
/// and values live and how to scale scores.
pub struct Head<'a, E: KvElem> {
    layer: usize,
    kv_head: usize,
    q: &'a [f32],
    slot: &'a TokenSlot<'a>,
    scale: f32,
    cache: &'a KvCache<E>,
}

/// `out[t, h] = softmax(q[t, h] . K[0..=pos] / sqrt(d)) V[0..=pos]` for every token and query head;
/// `q` and `out` are `(tokens, n_heads * head_dim)`. The query heads of one KV head are adjacent, so
/// a group's rows of `q` and `out` are one contiguous run.
pub fn attend<E: AttendElem>(
    layer: usize,
    q: &[f32],
    slots: &[TokenSlot],
    shape: &AttentionShape,
    cache: &KvCache<E>,
    out: &mut [f32],
    pool: &Pool,
) {
    let group_len = shape.group * shape.head_dim;
    let kv_heads = shape.n_heads / shape.group;
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    pool.for_each_row_mut(out, group_len, 1, |unit, out_group| {
        let (t, kv_head) = (unit / kv_heads, unit % kv_heads);
        let q = &q[unit * group_len..(unit + 1) * group_len];
        E::attend_group(&Head { layer, kv_head, q, slot: &slots[t], scale, cache }, out_group);
    });
}

/// A KV element type attention can read, with the fastest build of the group loop this CPU has.
/// `head.q` and `out` hold every query head of `head.kv_head`, `head_dim` values each.
pub trait AttendElem: KvElem {
    fn attend_group(head: &Head<Self>, out: &mut [f32]);
}

/// Each query head of a group through the per-head loop `one`.
fn per_head<E: KvElem>(head: &Head<E>, out: &mut [f32], d: usize, one: impl Fn(&Head<E>, &mut [f32])) {
    for (q, out_head) in head.q.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        one(&Head { q, ..*head }, out_head);
    }
}

impl AttendElem for f32 {
    /// The AVX2 + FMA build of the generic loop where the CPU has them (same operations, same order).
    fn attend_group(head: &Head<f32>, out: &mut [f32]) {
        let d = head.cache.layout().head_dim;
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx2() {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return per_head(head, out, d, |h, o| unsafe { x86::attend_avx2(h, o) });
        }
        per_head(head, out, d, attend_body::<f32, Portable>)
    }
}

impl AttendElem for I8 {
    /// The AVX-512 group kernel where it applies; else the AVX2 one where the CPU has AVX2, FMA and
    /// F16C; the generic loop per head elsewhere.
    fn attend_group(head: &Head<I8>, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::attend_group(head, out) {
                return;
            }
            if f16c::available() {
                // SAFETY: the CPU supports AVX2, FMA and F16C (checked just above).
                return unsafe { f16c::attend_group(head, out) };
            }
        }
        per_head(head, out, head.cache.layout().head_dim, attend_body::<I8, Portable>)
    }
}

impl AttendElem for F16 {
    /// The AVX-512 group kernel where it applies; else the AVX2 + F16C one where the CPU has them; the
    /// generic loop per head elsewhere.
    fn attend_group(head: &Head<F16>, out: &mut [f32]) {
        let d = head.cache.layout().head_dim;
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::attend_group(head, out) {
                return;
            }
            if f16c::available() {
                // SAFETY: the CPU supports AVX2, FMA and F16C (checked just above).
                return unsafe { f16c::attend_group(head, out) };
            }
        }
        per_head(head, out, d, attend_body::<F16, Portable>)
    }
}

/// One query head over its KV head: plain Rust, vectorized by the compiler for whatever target the
/// caller is built for (the generic build, or the AVX2 + FMA one for f32 KV), its multiply-adds
/// rounded once by `F` (the instruction or [`Portable`]). The definition every other build matches
/// bit for bit (the module doc).
#[inline(always)]
fn attend_body<E: KvElem, F: MulAdd>(head: &Head<E>, out: &mut [f32]) {
    let Head { layer, kv_head, q, slot, scale, cache } = *head;
    let d = q.len();
    let seen = slot.pos + 1;
    let mut scores = Vec::with_capacity(seen);
    for (b, &block) in slot.block_table[..seen.div_ceil(BLOCK_TOKENS)].iter().enumerate() {
        let keys = cache.keys(layer, block as usize, kv_head);
        let used = (seen - b * BLOCK_TOKENS).min(BLOCK_TOKENS);
        let scores_of_block = score_block::<E, F>(q, keys, cache.key_scales(layer, block as usize, kv_head), scale);
        scores.extend_from_slice(&scores_of_block[..used]);
    }
    let total = softmax_unnormalized(&mut scores);
    out.fill(0.0);
    for (b, &block) in slot.block_table[..seen.div_ceil(BLOCK_TOKENS)].iter().enumerate() {
        let values = cache.values(layer, block as usize, kv_head);
        let v_scales = cache.value_scales(layer, block as usize, kv_head);
        let weights = &scores[b * BLOCK_TOKENS..(b * BLOCK_TOKENS + BLOCK_TOKENS).min(seen)];
        for ((&w, v), &v_scale) in weights.iter().zip(values.chunks_exact(d)).zip(v_scales) {
            E::axpy::<F>(out, if E::SCALED { w * v_scale } else { w }, v);
        }
    }
    let inverse = 1.0 / total;
    out.iter_mut().for_each(|o| *o *= inverse);
}

/// `s = exp(s - max)` in place; returns the sum, added in order. The sampler's polynomial exp
/// (relative error < 3e-7) vectorizes where libm's does not.
#[inline(always)]
fn softmax_unnormalized(scores: &mut [f32]) -> f32 {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for s in scores.iter_mut() {
        *s = exp_nonpositive(*s - max);
    }
    scores.iter().sum()
}

/// `q . k_j * scale` for the 16 keys of one block (stored transposed, `[dim][slot]`): 16-wide fused
/// multiply-adds into four partial sums (dimension `d % 4`), each over its dimensions in order; a
/// scaled type's sums (of its stored integers) are times each key's row scale before `scale`.
#[inline(always)]
fn score_block<E: KvElem, F: MulAdd>(
    q: &[f32],
    keys: &[E],
    k_scales: &[f32; BLOCK_TOKENS],
    scale: f32,
) -> [f32; BLOCK_TOKENS] {
    let mut acc = [[0.0f32; BLOCK_TOKENS]; 4];
    for (dim, (&qd, row)) in q.iter().zip(keys.chunks_exact(BLOCK_TOKENS)).enumerate() {
        let part = &mut acc[dim % 4];
        for j in 0..BLOCK_TOKENS {
            part[j] = F::mul_add(qd, row[j].to_f32(), part[j]);
        }
    }
    std::array::from_fn(|j| {
        let dot = (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]);
        if E::SCALED {
            dot * k_scales[j] * scale
        } else {
            dot * scale
        }
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! x86 pieces of the loops: the generic per-head loop compiled for AVX2 + FMA (f32 KV), and the
    //! L2 prefetch the group kernels share.

    use std::arch::x86_64::*;

    use super::{attend_body, Head};
    use crate::fused::Instruction;
    use crate::kv::KvElem;
    use crate::q1::Isa;

    /// AVX2 with FMA and F16C, unless `OXIBONSAI_ISA` asks for less ([`Isa::detect`]).
    pub fn has_avx2() -> bool {
        Isa::detect().has_avx2()
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn attend_avx2(head: &Head<f32>, out: &mut [f32]) {
        attend_body::<f32, Instruction>(head, out)
    }

    /// How many pieces ahead of the one being worked on a group kernel asks for (a piece is one
    /// block's keys or values of one KV head, in [`ahead`]'s order). One ahead left a Zen 4 core
    /// waiting on memory (`examples/attention_speed`, one thread): two ahead took f16 at 512
    /// positions from 3.38-3.53 to 2.86 ms a token and int8 from 2.49-2.56 to 2.05.
    pub const AHEAD: usize = 3;

    /// Piece `i` of what `head`'s group reads over `blocks`, in the order it reads them: every
    /// block's keys, then every block's values; `None` past the end.
    #[inline(always)]
    pub fn ahead<'a, E: KvElem>(head: &Head<'a, E>, blocks: &[u32], i: usize) -> Option<&'a [E]> {
        let (cache, layer, kv_head) = (head.cache, head.layer, head.kv_head);
        match blocks.get(i) {
            Some(&b) => Some(cache.keys(layer, b as usize, kv_head)),
            None => blocks.get(i - blocks.len()).map(|&b| cache.values(layer, b as usize, kv_head)),
        }
    }

    /// Asks for the row scales of block `blocks[i]` (keys' and values'), where it exists and `E` has
    /// them.
    #[inline(always)]
    pub fn prefetch_scales<E: KvElem>(head: &Head<E>, blocks: &[u32], i: usize) {
        if let (true, Some(&b)) = (E::SCALED, blocks.get(i)) {
            prefetch_l2(head.cache.key_scales(head.layer, b as usize, head.kv_head));
            prefetch_l2(head.cache.value_scales(head.layer, b as usize, head.kv_head));
        }
    }

    /// Asks for the cache lines of `piece` into L2 (`T1`), without waiting for them. Into L2 rather
    /// than L1: L2 tracks more misses in flight, and a block's 4 KiB pieces scattered by the block
    /// table need them. On Zen 4 at 512 positions (`examples/attention_speed.rs`), `T0` read
    /// 10.6-11.0 GB/s on one core and `T1` 12.7-15.9; on two, 21.6-23.2 against 27.9-31.4.
    #[inline(always)]
    pub fn prefetch_l2<T>(piece: &[T]) {
        for line in piece.chunks(64 / std::mem::size_of::<T>()) {
            // SAFETY: prefetching is a hint; the address is inside `piece`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvLayout;

    /// A random one-head cache of `n` tokens and a query, deterministic per `seed`.
    fn fixture<E: KvElem>(n: usize, seed: u32) -> (KvCache<E>, Vec<f32>) {
        let layout = KvLayout { n_layers: 1, n_kv_heads: 1, head_dim: 132 };
        let mut cache = KvCache::new(layout, n.div_ceil(BLOCK_TOKENS)).unwrap();
        let value = |i: usize| (i as f32 * 0.618 + seed as f32).sin() * 3.0;
        for t in 0..n {
            let k: Vec<f32> = (0..132).map(|d| value(t * 1000 + d)).collect();
            let v: Vec<f32> = (0..132).map(|d| value(t * 7000 + d + 3)).collect();
            cache.write(0, t / BLOCK_TOKENS, t % BLOCK_TOKENS, &k, &v);
        }
        (cache, (0..132).map(|d| value(d + 99) * 0.1).collect())
    }

    fn run<E: KvElem>(cache: &KvCache<E>, q: &[f32], pos: usize) -> Vec<f32> {
        let table: Vec<u32> = (0..cache.num_blocks() as u32).collect();
        let slot = TokenSlot { pos, block_table: &table };
        let mut out = vec![0.0; q.len()];
        attend_body::<E, Portable>(&Head { layer: 0, kv_head: 0, q, slot: &slot, scale: 0.1, cache }, &mut out);
        out
    }

    #[test]
    fn f16_builds_agree_with_the_f32_cache() {
        let (exact, q) = fixture::<f32>(45, 1);
        let (half, _) = fixture::<F16>(45, 1);
        for pos in [0, 15, 16, 44] {
            let want = run::<f32>(&exact, &q, pos);
            let generic = run::<F16>(&half, &q, pos);
            assert!(want.iter().zip(&generic).all(|(a, b)| (a - b).abs() < 1e-2), "pos {pos}");
        }
    }

    #[test]
    fn int8_cache_agrees_with_the_f32_cache_within_its_rounding() {
        for seed in 0..8 {
            let (exact, q) = fixture::<f32>(45, seed);
            let (int8, _) = fixture::<I8>(45, seed);
            for pos in [0, 15, 16, 44] {
                let want = run::<f32>(&exact, &q, pos);
                let got = run::<I8>(&int8, &q, pos);
                // Values of magnitude <= 3 stored in steps of 3/127: half a step is 0.012 per element.
                let worst = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                assert!(worst < 0.03, "seed {seed} pos {pos}: {worst}");
                assert!(worst > 0.0, "seed {seed} pos {pos}: int8 rounds");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_per_head_loop_matches_the_portable_one_bit_for_bit() {
        if !x86::has_avx2() {
            return;
        }
        for seed in 0..4 {
            let (exact, q) = fixture::<f32>(45, seed);
            let table: Vec<u32> = (0..exact.num_blocks() as u32).collect();
            for pos in [0, 20, 44] {
                let slot = TokenSlot { pos, block_table: &table };
                let (mut fast, mut want) = (vec![0.0; q.len()], vec![0.0; q.len()]);
                let head = Head { layer: 0, kv_head: 0, q: &q, slot: &slot, scale: 0.1, cache: &exact };
                // SAFETY: the CPU supports AVX2 and FMA (checked above).
                unsafe { x86::attend_avx2(&head, &mut fast) };
                attend_body::<f32, Portable>(&head, &mut want);
                assert_eq!(bits(&want), bits(&fast), "seed {seed} pos {pos}");
            }
        }
    }

    /// A random two-KV-head cache of `n` tokens with head dim `d` (written to layer 1, its blocks in
    /// reverse order, as a block table may hold them), deterministic per `seed`.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn reversed_cache<E: KvElem>(n: usize, d: usize, seed: u32) -> KvCache<E> {
        let layout = KvLayout { n_layers: 2, n_kv_heads: 2, head_dim: d };
        let mut cache = KvCache::new(layout, n.div_ceil(BLOCK_TOKENS) + 3).unwrap();
        let value = |i: usize| (i as f32 * 0.618 + seed as f32).sin() * 3.0;
        for t in 0..n {
            let k: Vec<f32> = (0..2 * d).map(|i| value(t * 1000 + i)).collect();
            let v: Vec<f32> = (0..2 * d).map(|i| value(t * 7000 + i + 3)).collect();
            cache.write(1, n.div_ceil(BLOCK_TOKENS) - 1 - t / BLOCK_TOKENS, t % BLOCK_TOKENS, &k, &v);
        }
        cache
    }

    #[cfg(target_arch = "x86_64")]
    type GroupKernel<E> = fn(&Head<E>, &mut [f32]) -> bool;

    /// [`f16c::attend_group`] as a [`GroupKernel`]; only listed where the CPU supports it.
    #[cfg(target_arch = "x86_64")]
    fn f16c_group<E: f16c::Widen8>(head: &Head<E>, out: &mut [f32]) -> bool {
        // SAFETY: `group_kernels` lists this only where `f16c::available()`.
        unsafe { f16c::attend_group(head, out) };
        true
    }

    /// The group kernels of `E` this CPU can run, by name; each returns false where it declines.
    #[cfg(target_arch = "x86_64")]
    fn group_kernels<E: f16c::Widen8 + avx512::Widen16>() -> Vec<(&'static str, GroupKernel<E>)> {
        let mut kernels: Vec<(&'static str, GroupKernel<E>)> = vec![("avx512", avx512::attend_group::<E>)];
        if f16c::available() {
            kernels.push(("f16c", f16c_group::<E>));
        }
        kernels
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// `kernel` against the per-head loop over caches of several shapes, every head bit for bit.
    #[cfg(target_arch = "x86_64")]
    fn check_group_kernel<E: KvElem>(name: &str, kernel: GroupKernel<E>) {
        for (d, group, n) in [(128, 2, 45), (128, 3, 16), (64, 4, 33), (128, 1, 1), (132, 2, 20), (66, 2, 19)] {
            let cache = reversed_cache::<E>(n, d, d as u32 + group as u32);
            let table: Vec<u32> = (0..n.div_ceil(BLOCK_TOKENS) as u32).rev().collect();
            let q: Vec<f32> = (0..group * d).map(|i| (i as f32 * 0.37).cos() * 0.3).collect();
            for pos in [0, n / 2, n - 1] {
                let slot = TokenSlot { pos, block_table: &table };
                let head = Head { layer: 1, kv_head: 1, q: &q, slot: &slot, scale: 0.1, cache: &cache };
                let mut fast = vec![f32::NAN; group * d];
                if !kernel(&head, &mut fast) {
                    continue;
                }
                for (h, (qh, got)) in q.chunks_exact(d).zip(fast.chunks_exact(d)).enumerate() {
                    let mut want = vec![0.0; d];
                    attend_body::<E, Portable>(&Head { q: qh, ..head }, &mut want);
                    assert_eq!(bits(&want), bits(got), "{name}: d {d} group {group} pos {pos} head {h}");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn group_kernels_match_the_per_head_loop_bit_for_bit() {
        for (name, kernel) in group_kernels::<F16>() {
            check_group_kernel::<F16>(name, kernel);
        }
        for (name, kernel) in group_kernels::<I8>() {
            check_group_kernel::<I8>(&format!("{name} int8"), kernel);
        }
    }
}

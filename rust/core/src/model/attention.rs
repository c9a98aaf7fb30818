//! Grouped-query causal attention of a batch of tokens over the paged KV cache. Each (token, query
//! head) pair is computed alone, reading keys and values through its sequence's block table, so a
//! token's output is the same whether it ran in a prefill batch or alone in a decode step.

use crate::kv::{KvCache, KvElem, BLOCK_TOKENS};
use crate::pool::Pool;

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

/// One (token, query head) to compute: where its keys and values live and how to scale scores.
struct Head<'a, E: KvElem> {
    layer: usize,
    kv_head: usize,
    q: &'a [f32],
    slot: &'a TokenSlot<'a>,
    scale: f32,
    cache: &'a KvCache<E>,
}

/// `out[t, h] = softmax(q[t, h] . K[0..=pos] / sqrt(d)) V[0..=pos]` for every token and query head;
/// `q` and `out` are `(tokens, n_heads * head_dim)`.
pub fn attend<E: KvElem>(
    layer: usize,
    q: &[f32],
    slots: &[TokenSlot],
    shape: &AttentionShape,
    cache: &KvCache<E>,
    out: &mut [f32],
    pool: &Pool,
) {
    let d = shape.head_dim;
    let scale = 1.0 / (d as f32).sqrt();
    pool.for_each_row_mut(out, d, 4, |row, out_head| {
        let (t, h) = (row / shape.n_heads, row % shape.n_heads);
        let q = &q[row * d..(row + 1) * d];
        attend_one(&Head { layer, kv_head: h / shape.group, q, slot: &slots[t], scale, cache }, out_head);
    });
}

/// One (token, head): the AVX2 build of [`attend_body`] where the CPU has it. Both builds run the same
/// operations in the same order, so they give identical results.
fn attend_one<E: KvElem>(head: &Head<E>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { attend_avx2(head, out) };
    }
    attend_body(head, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_avx2<E: KvElem>(head: &Head<E>, out: &mut [f32]) {
    attend_body(head, out)
}

#[inline(always)]
fn attend_body<E: KvElem>(head: &Head<E>, out: &mut [f32]) {
    let Head { layer, kv_head, q, slot, scale, cache } = *head;
    let d = q.len();
    let seen = slot.pos + 1;
    let mut scores = Vec::with_capacity(seen);
    for (b, &block) in slot.block_table[..seen.div_ceil(BLOCK_TOKENS)].iter().enumerate() {
        let keys = cache.keys(layer, block as usize, kv_head);
        let used = (seen - b * BLOCK_TOKENS).min(BLOCK_TOKENS);
        scores.extend_from_slice(&score_block::<E>(q, keys, scale)[..used]);
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        total += *s;
    }
    out.fill(0.0);
    for (b, &block) in slot.block_table[..seen.div_ceil(BLOCK_TOKENS)].iter().enumerate() {
        let values = cache.values(layer, block as usize, kv_head);
        let weights = &scores[b * BLOCK_TOKENS..(b * BLOCK_TOKENS + BLOCK_TOKENS).min(seen)];
        for (w, v) in weights.iter().zip(values.chunks_exact(d)) {
            E::axpy(out, w / total, v);
        }
    }
}

/// `q . k_j * scale` for the 16 keys of one block (stored transposed, `[dim][slot]`): 16-wide
/// multiply-adds over the head dimension, in dimension order.
#[inline(always)]
fn score_block<E: KvElem>(q: &[f32], keys: &[E], scale: f32) -> [f32; BLOCK_TOKENS] {
    let mut acc = [0.0f32; BLOCK_TOKENS];
    for (&qd, row) in q.iter().zip(keys.chunks_exact(BLOCK_TOKENS)) {
        for j in 0..BLOCK_TOKENS {
            acc[j] += qd * row[j].to_f32();
        }
    }
    acc.map(|a| a * scale)
}

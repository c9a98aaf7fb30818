//! `Qwen3Model`: the CPU forward pass of a batch of sequence chunks over the paged KV cache.
//! All tokens of the batch go through each matmul together (the Q1 GEMM for prefill and batched
//! decode); attention reads each sequence's own blocks. Inputs are validated by the caller
//! ([`super::runner`]); this file only computes.

use crate::error::Result;
use crate::kv::{KvCache, KvLayout, BLOCK_TOKENS};
use crate::pool::Pool;
use crate::step::Logits;

use super::attention::{attend, AttendElem, AttentionShape, TokenSlot};
use super::config::Qwen3Config;
use super::linear::{Linear, MatmulPlan};
use super::ops::{rms_norm, rms_norm_in_place, swiglu_in_place};
use super::rope::RopeTable;
use super::weights::{LayerWeights, Qwen3Weights};

/// `tokens` of one sequence at positions `start..start + tokens.len()`, stored through `block_table`.
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub block_table: &'a [u32],
    pub logits: Logits,
}

/// What a forward pass returns for its wanted rows: the logits (the LM head), or the final
/// RMS-normed hidden states (what the LM head reads; an embedding model's output).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    Logits,
    Hidden,
}

/// A loaded Qwen3 model and how its matmuls run.
pub struct Qwen3Model {
    pub config: Qwen3Config,
    pub weights: Qwen3Weights,
    pub plan: MatmulPlan,
    /// The file's [`tensor_fingerprint`](crate::gguf::GgufFile::tensor_fingerprint).
    pub fingerprint: u64,
}

/// Rows of activations of the whole batch.
struct Batch<'a> {
    n: usize,
    slots: Vec<TokenSlot<'a>>,
    rope: RopeTable,
}

impl Qwen3Model {
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout { n_layers: self.config.n_layers, n_kv_heads: self.config.n_kv_heads, head_dim: self.config.head_dim }
    }

    /// Runs the chunks, writing their keys and values into `cache`; appends the requested rows (in
    /// chunk order) to `out`: logits (`rows x vocab`) or, with [`Head::Hidden`], the final-normed
    /// hidden states (`rows x hidden`).
    pub fn forward<E: AttendElem>(
        &self,
        chunks: &[SeqChunk],
        cache: &mut KvCache<E>,
        pool: &Pool,
        head: Head,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let c = &self.config;
        let slots: Vec<TokenSlot> = chunks
            .iter()
            .flat_map(|ch| (0..ch.tokens.len()).map(|i| TokenSlot { pos: ch.start + i, block_table: ch.block_table }))
            .collect();
        let positions: Vec<usize> = slots.iter().map(|s| s.pos).collect();
        let batch = Batch { n: slots.len(), rope: c.rope().table(&positions), slots };
        let mut s = Scratch::new(c, batch.n);
        let tokens = chunks.iter().flat_map(|ch| ch.tokens.iter());
        for (row, &token) in s.x.chunks_exact_mut(c.hidden).zip(tokens) {
            self.weights.token_embd.row(token as usize, row);
        }
        for (i, layer) in self.weights.layers.iter().enumerate() {
            self.layer(i, layer, &batch, &mut s, cache, pool)?;
        }
        self.head(chunks, &s.x, pool, head, out)
    }

    fn layer<E: AttendElem>(
        &self,
        index: usize,
        w: &LayerWeights,
        batch: &Batch,
        s: &mut Scratch,
        cache: &mut KvCache<E>,
        pool: &Pool,
    ) -> Result<()> {
        let (c, n, plan) = (&self.config, batch.n, self.plan);
        self.norm_rows(&s.x, &w.attn_norm, &mut s.h, pool);
        Linear::forward_shared(&[&w.wq, &w.wk, &w.wv], &s.h, n, &mut [&mut s.q, &mut s.k, &mut s.v], plan, pool)?;
        self.qk_norm_rope(&mut s.q, &w.q_norm, batch, pool);
        self.qk_norm_rope(&mut s.k, &w.k_norm, batch, pool);
        let kv = c.kv_dim();
        for (t, slot) in batch.slots.iter().enumerate() {
            let block = slot.block_table[slot.pos / BLOCK_TOKENS] as usize;
            cache.write(index, block, slot.pos % BLOCK_TOKENS, &s.k[t * kv..][..kv], &s.v[t * kv..][..kv]);
        }
        let shape = AttentionShape { n_heads: c.n_heads, group: c.group(), head_dim: c.head_dim };
        attend(index, &s.q, &batch.slots, &shape, cache, &mut s.attn, pool);
        w.wo.forward(&s.attn, n, &mut s.out, plan, pool)?;
        add(&mut s.x, &s.out);

        self.norm_rows(&s.x, &w.ffn_norm, &mut s.h, pool);
        Linear::forward_shared(&[&w.w_gate, &w.w_up], &s.h, n, &mut [&mut s.gate, &mut s.up], plan, pool)?;
        let (ffn, up) = (c.ffn, &s.up);
        pool.for_each_row_mut(&mut s.gate, ffn, 8, |r, row| swiglu_in_place(row, &up[r * ffn..(r + 1) * ffn]));
        w.w_down.forward(&s.gate, n, &mut s.out, plan, pool)?;
        add(&mut s.x, &s.out);
        Ok(())
    }

    fn norm_rows(&self, x: &[f32], weight: &[f32], out: &mut [f32], pool: &Pool) {
        let hidden = weight.len();
        pool.for_each_row_mut(out, hidden, 16, |r, row| {
            rms_norm(&x[r * hidden..(r + 1) * hidden], weight, self.config.rms_eps, row);
        });
    }

    /// Per-head RMSNorm, then RoPE at each token's position.
    fn qk_norm_rope(&self, heads: &mut [f32], weight: &[f32], batch: &Batch, pool: &Pool) {
        let d = self.config.head_dim;
        let per_token = heads.len() / batch.n / d;
        pool.for_each_row_mut(heads, d, 64, |row, head| {
            rms_norm_in_place(head, weight, self.config.rms_eps);
            batch.rope.rotate(row / per_token, head);
        });
    }

    fn head(&self, chunks: &[SeqChunk], x: &[f32], pool: &Pool, head: Head, out: &mut Vec<f32>) -> Result<()> {
        let hidden = self.config.hidden;
        let mut wanted = Vec::new();
        let mut first = 0;
        for ch in chunks {
            let rows = first..first + ch.tokens.len();
            match ch.logits {
                Logits::None => {}
                Logits::Last => wanted.push(rows.end - 1),
                Logits::All => wanted.extend(rows),
            }
            first += ch.tokens.len();
        }
        let mut h: Vec<f32> = wanted.iter().flat_map(|&r| x[r * hidden..(r + 1) * hidden].iter().copied()).collect();
        pool.for_each_row_mut(&mut h, hidden, 16, |_, row| {
            rms_norm_in_place(row, &self.weights.output_norm, self.config.rms_eps)
        });
        if head == Head::Hidden {
            out.extend_from_slice(&h);
            return Ok(());
        }
        let lm_head = self.weights.lm_head();
        let start = out.len();
        out.resize(start + wanted.len() * lm_head.rows(), 0.0);
        lm_head.forward(&h, wanted.len(), &mut out[start..], self.plan, pool)
    }
}

/// Activation buffers of one forward pass, allocated once and reused by every layer (fresh large
/// allocations per layer cost page faults and zeroing).
struct Scratch {
    /// The residual stream.
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    out: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Scratch {
    fn new(c: &Qwen3Config, n: usize) -> Scratch {
        let buf = |width: usize| vec![0.0f32; n * width];
        Scratch {
            x: buf(c.hidden),
            h: buf(c.hidden),
            q: buf(c.q_dim()),
            k: buf(c.kv_dim()),
            v: buf(c.kv_dim()),
            attn: buf(c.q_dim()),
            out: buf(c.hidden),
            gate: buf(c.ffn),
            up: buf(c.ffn),
        }
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

//! `Qwen3Model`: the CPU forward pass of a batch of sequence chunks over the paged KV cache.
//! All tokens of the batch go through each matmul together (the Q1 GEMM for prefill and batched
//! decode); attention reads each sequence's own blocks. Inputs are validated by the caller
//! ([`super::runner`]); this file only computes.

use crate::error::Result;
use crate::kv::{KvCache, KvElem, KvLayout, BLOCK_TOKENS};
use crate::pool::Pool;

use super::attention::{attend, AttentionShape, TokenSlot};
use super::config::Qwen3Config;
use super::linear::{Linear, MatmulPlan};
use super::ops::{rms_norm, rms_norm_in_place, swiglu_in_place, RopeTable};
use super::weights::{LayerWeights, Qwen3Weights};

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// `tokens` of one sequence at positions `start..start + tokens.len()`, stored through `block_table`.
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub block_table: &'a [u32],
    pub logits: Logits,
}

/// A loaded Qwen3 model and how its matmuls run.
pub struct Qwen3Model {
    pub config: Qwen3Config,
    pub weights: Qwen3Weights,
    pub plan: MatmulPlan,
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

    /// Runs the chunks, writing their keys and values into `cache`; returns the requested logits rows
    /// (`rows x vocab`) in chunk order.
    pub fn forward<E: KvElem>(&self, chunks: &[SeqChunk], cache: &mut KvCache<E>, pool: &Pool) -> Result<Vec<f32>> {
        let c = &self.config;
        let slots: Vec<TokenSlot> = chunks
            .iter()
            .flat_map(|ch| (0..ch.tokens.len()).map(|i| TokenSlot { pos: ch.start + i, block_table: ch.block_table }))
            .collect();
        let positions: Vec<usize> = slots.iter().map(|s| s.pos).collect();
        let batch = Batch { n: slots.len(), rope: RopeTable::new(&positions, c.head_dim, c.rope_base), slots };
        let mut x = vec![0.0f32; batch.n * c.hidden];
        let tokens = chunks.iter().flat_map(|ch| ch.tokens.iter());
        for (row, &token) in x.chunks_exact_mut(c.hidden).zip(tokens) {
            self.weights.token_embd.row(token as usize, row);
        }
        for (i, layer) in self.weights.layers.iter().enumerate() {
            self.layer(i, layer, &batch, &mut x, cache, pool)?;
        }
        self.logits(chunks, &x, pool)
    }

    fn layer<E: KvElem>(
        &self,
        index: usize,
        w: &LayerWeights,
        batch: &Batch,
        x: &mut [f32],
        cache: &mut KvCache<E>,
        pool: &Pool,
    ) -> Result<()> {
        let c = &self.config;
        let h = self.norm_rows(x, &w.attn_norm, pool);
        let mut q = self.project(&w.wq, &h, batch.n, pool)?;
        let mut k = self.project(&w.wk, &h, batch.n, pool)?;
        let v = self.project(&w.wv, &h, batch.n, pool)?;
        self.qk_norm_rope(&mut q, &w.q_norm, batch, pool);
        self.qk_norm_rope(&mut k, &w.k_norm, batch, pool);
        for (t, slot) in batch.slots.iter().enumerate() {
            let block = slot.block_table[slot.pos / BLOCK_TOKENS] as usize;
            let kv = c.kv_dim();
            cache.write(index, block, slot.pos % BLOCK_TOKENS, &k[t * kv..][..kv], &v[t * kv..][..kv]);
        }
        let mut attn = vec![0.0f32; batch.n * c.q_dim()];
        let shape = AttentionShape { n_heads: c.n_heads, group: c.group(), head_dim: c.head_dim };
        attend(index, &q, &batch.slots, &shape, cache, &mut attn, pool);
        add(x, &self.project(&w.wo, &attn, batch.n, pool)?);

        let h = self.norm_rows(x, &w.ffn_norm, pool);
        let mut gate = self.project(&w.w_gate, &h, batch.n, pool)?;
        let up = self.project(&w.w_up, &h, batch.n, pool)?;
        swiglu_in_place(&mut gate, &up);
        add(x, &self.project(&w.w_down, &gate, batch.n, pool)?);
        Ok(())
    }

    fn project(&self, w: &Linear, x: &[f32], n: usize, pool: &Pool) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; n * w.rows()];
        w.forward(x, n, &mut out, self.plan, pool)?;
        Ok(out)
    }

    fn norm_rows(&self, x: &[f32], weight: &[f32], pool: &Pool) -> Vec<f32> {
        let hidden = weight.len();
        let mut out = vec![0.0f32; x.len()];
        pool.for_each_row_mut(&mut out, hidden, 16, |r, row| {
            rms_norm(&x[r * hidden..(r + 1) * hidden], weight, self.config.rms_eps, row);
        });
        out
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

    fn logits(&self, chunks: &[SeqChunk], x: &[f32], pool: &Pool) -> Result<Vec<f32>> {
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
        self.project(self.weights.lm_head(), &h, wanted.len(), pool)
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

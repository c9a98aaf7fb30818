//! `ModelRunner`: a model, the memory of its KV cache, and the [`SequenceTable`] of sequences
//! living in it (their block tables and the prefix cache). It checks every step before the forward
//! pass (token ids, context length, free blocks) and splits large batches so activations stay
//! bounded. A failed check changes nothing; lengths only advance after the forward pass succeeds.

use crate::error::{Error, Result};
use crate::kv::{blocks_for, SequenceTable};
use crate::kv::{KvCache, KvElem, KvLayout, F16, I8};
use crate::pool::Pool;
use crate::step::{Logits, StepItem};

use super::forward::{Head, Qwen3Model, SeqChunk};
use super::rope::RopeScaling;

/// Most tokens in one forward pass; longer prompts run in several (chunked prefill).
pub const MAX_BATCH_TOKENS: usize = 256;

/// The context used when none is asked for: the model's own, capped so the KV cache stays modest.
pub const DEFAULT_MAX_MODEL_LEN: usize = 4096;

/// The KV cache budget used when neither a block count nor a byte budget is given.
pub const DEFAULT_KV_CACHE_BYTES: usize = 2 << 30;

/// The element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    I8,
}

impl KvDtype {
    pub fn parse(name: &str) -> Result<KvDtype> {
        match name {
            // f16 is the default, as in llama.cpp: half the memory and KV bandwidth; f32 is exact;
            // int8 (one scale per token and head) halves f16's memory again.
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "auto" => Ok(KvDtype::F16),
            "int8" => Ok(KvDtype::I8),
            _ => Err(Error::Value(format!("kv_cache_dtype must be 'auto', 'f16', 'f32' or 'int8', got {name:?}"))),
        }
    }

    /// The name [`parse`](Self::parse) takes for it: "f32", "f16" or "int8".
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => f32::NAME,
            KvDtype::F16 => F16::NAME,
            KvDtype::I8 => I8::NAME,
        }
    }

    /// Bytes of keys and values (and row scales) one block of `layout` holds over all layers.
    pub fn block_bytes(self, layout: KvLayout) -> usize {
        match self {
            KvDtype::F32 => layout.block_bytes::<f32>(),
            KvDtype::F16 => layout.block_bytes::<F16>(),
            KvDtype::I8 => layout.block_bytes::<I8>(),
        }
    }
}

/// The cache in its element type.
enum KvStore {
    F32(KvCache<f32>),
    F16(KvCache<F16>),
    I8(KvCache<I8>),
}

impl KvStore {
    fn read_block(&self, block: usize, out: &mut Vec<u8>) {
        match self {
            KvStore::F32(cache) => cache.read_block(block, out),
            KvStore::F16(cache) => cache.read_block(block, out),
            KvStore::I8(cache) => cache.read_block(block, out),
        }
    }

    fn write_block(&mut self, block: usize, bytes: &[u8]) -> Result<()> {
        match self {
            KvStore::F32(cache) => cache.write_block(block, bytes),
            KvStore::F16(cache) => cache.write_block(block, bytes),
            KvStore::I8(cache) => cache.write_block(block, bytes),
        }
    }

    fn forward(
        &mut self,
        model: &Qwen3Model,
        batch: &[SeqChunk],
        pool: &Pool,
        head: Head,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        match self {
            KvStore::F32(cache) => model.forward(batch, cache, pool, head, out),
            KvStore::F16(cache) => model.forward(batch, cache, pool, head, out),
            KvStore::I8(cache) => model.forward(batch, cache, pool, head, out),
        }
    }
}

fn new_store<E: KvElem>(model: &Qwen3Model, num_blocks: usize) -> Result<KvCache<E>> {
    KvCache::new(model.kv_layout(), num_blocks)
}

pub struct ModelRunner {
    model: Qwen3Model,
    kv: KvStore,
    dtype: KvDtype,
    table: SequenceTable,
    max_model_len: usize,
    computed_tokens: u64,
}

impl ModelRunner {
    /// A runner with `num_blocks` KV blocks and prefix caching on.
    pub fn new(model: Qwen3Model, num_blocks: usize, max_model_len: usize, dtype: KvDtype) -> Result<ModelRunner> {
        let longest = model.config.max_positions();
        if max_model_len == 0 || max_model_len > longest {
            let scaled = if model.config.rope_scaling == RopeScaling::None { "" } else { ", with its rope scaling" };
            return Err(Error::Value(format!(
                "max_model_len must be in 1..={longest} (the model's context length{scaled}), got {max_model_len}"
            )));
        }
        if num_blocks == 0 {
            return Err(Error::Value("the KV cache needs at least one block".into()));
        }
        let kv = match dtype {
            KvDtype::F32 => KvStore::F32(new_store(&model, num_blocks)?),
            KvDtype::F16 => KvStore::F16(new_store(&model, num_blocks)?),
            KvDtype::I8 => KvStore::I8(new_store(&model, num_blocks)?),
        };
        let table = SequenceTable::new(num_blocks, dtype.block_bytes(model.kv_layout()), true);
        Ok(ModelRunner { model, kv, dtype, table, max_model_len, computed_tokens: 0 })
    }

    pub fn model(&self) -> &Qwen3Model {
        &self.model
    }

    pub fn kv_dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Bytes of keys and values one block holds over all layers.
    pub fn block_bytes(&self) -> usize {
        self.dtype.block_bytes(self.model.kv_layout())
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// The sequences and their blocks (read-only).
    pub fn table(&self) -> &SequenceTable {
        &self.table
    }

    /// The sequences and their blocks: starting, freeing, prefix-cache settings. Block tables only
    /// grow through [`step`](Self::step).
    /// Appends the KV bytes of `block` to `out` (see [`KvCache::read_block`]).
    pub fn read_block(&self, block: u32, out: &mut Vec<u8>) {
        self.kv.read_block(block as usize, out);
    }

    /// A new sequence holding `parent`'s KV ([`SequenceTable::fork`], with the copies made): a beam
    /// that branches off `parent` steps on from the same state without recomputing it.
    pub fn fork_sequence(&mut self, parent: u64) -> Result<u64> {
        let (child, copies) = self.table.fork(parent)?;
        let mut bytes = Vec::new();
        for (from, to) in copies {
            bytes.clear();
            self.kv.read_block(from as usize, &mut bytes);
            if let Err(error) = self.kv.write_block(to as usize, &bytes) {
                self.table.free_sequence(child)?;
                return Err(error);
            }
        }
        Ok(child)
    }

    /// The KV store and the sequence table together: what restoring a cached block writes.
    pub fn table_and_blocks(&mut self) -> (&mut SequenceTable, impl FnMut(u32, &[u8]) -> Result<()> + '_) {
        let kv = &mut self.kv;
        (&mut self.table, move |block, bytes| kv.write_block(block as usize, bytes))
    }

    pub fn table_mut(&mut self) -> &mut SequenceTable {
        &mut self.table
    }

    /// Tokens run through the forward pass since the runner was made (prefill and decode).
    pub fn computed_tokens(&self) -> u64 {
        self.computed_tokens
    }

    /// Blocks for `max_num_seqs` sequences of `max_model_len` tokens, capped by `budget_bytes`, but
    /// never fewer than one full sequence needs.
    pub fn default_blocks(max_model_len: usize, block_bytes: usize, max_num_seqs: usize, budget_bytes: usize) -> usize {
        let per_seq = blocks_for(max_model_len);
        let affordable = budget_bytes / block_bytes.max(1);
        per_seq.max(per_seq.saturating_mul(max_num_seqs).min(affordable))
    }

    /// Appends each item's tokens (less its drafts) to its sequence and returns the requested logits
    /// rows in item order.
    pub fn step(&mut self, items: &[StepItem], pool: &Pool) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        self.step_into(items, pool, &mut logits)?;
        Ok(logits)
    }

    /// [`step`](Self::step) writing the logits into `logits` (cleared first; its memory is reused, so
    /// a caller stepping again and again need not fault in fresh pages for every step's logits).
    pub fn step_into(&mut self, items: &[StepItem], pool: &Pool, logits: &mut Vec<f32>) -> Result<()> {
        self.run_into(items, pool, Head::Logits, logits)
    }

    /// [`step_into`](Self::step_into) returning, for the rows each item wants, the final-normed hidden
    /// states (`rows x hidden`) instead of logits: what an embedding is pooled from.
    pub fn hidden_into(&mut self, items: &[StepItem], pool: &Pool, hidden: &mut Vec<f32>) -> Result<()> {
        self.run_into(items, pool, Head::Hidden, hidden)
    }

    fn run_into(&mut self, items: &[StepItem], pool: &Pool, head: Head, out: &mut Vec<f32>) -> Result<()> {
        out.clear();
        self.check(items)?;
        let growth: Vec<(u64, usize)> = items.iter().map(|it| (it.seq, it.tokens.len())).collect();
        self.table.reserve(&growth)?;
        let mut batch: Vec<SeqChunk> = Vec::new();
        let mut batch_tokens = 0;
        for item in items {
            let seq = self.table.get(item.seq)?;
            let pieces = item.tokens.chunks(MAX_BATCH_TOKENS).collect::<Vec<_>>();
            let mut start = seq.len;
            for (i, piece) in pieces.iter().enumerate() {
                if batch_tokens + piece.len() > MAX_BATCH_TOKENS && !batch.is_empty() {
                    self.kv.forward(&self.model, &batch, pool, head, out)?;
                    batch.clear();
                    batch_tokens = 0;
                }
                let wanted = match item.logits {
                    Logits::Last if i + 1 < pieces.len() => Logits::None,
                    other => other,
                };
                batch.push(SeqChunk { tokens: piece, start, block_table: &seq.block_table, logits: wanted });
                batch_tokens += piece.len();
                start += piece.len();
            }
        }
        if !batch.is_empty() {
            self.kv.forward(&self.model, &batch, pool, head, out)?;
        }
        for item in items {
            self.table.append(item.seq, item.recorded())?;
            self.computed_tokens += item.tokens.len() as u64;
        }
        Ok(())
    }

    fn check(&self, items: &[StepItem]) -> Result<()> {
        let vocab = self.model.config.vocab;
        let mut seen = std::collections::HashSet::new();
        for item in items {
            let seq = self.table.get(item.seq)?;
            if !seen.insert(item.seq) {
                return Err(Error::Value(format!("sequence {} appears twice in one step", item.seq)));
            }
            if item.tokens.is_empty() || item.drafts >= item.tokens.len() {
                return Err(Error::Value(format!(
                    "sequence {}: a step needs at least one token not drafted",
                    item.seq
                )));
            }
            if let Some(bad) = item.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::Value(format!("token id {bad} is out of range for a vocabulary of {vocab}")));
            }
            let total = seq.len + item.tokens.len();
            if total > self.max_model_len {
                return Err(Error::Value(format!(
                    "sequence {} would hold {total} tokens, more than max_model_len={}",
                    item.seq, self.max_model_len
                )));
            }
        }
        Ok(())
    }
}

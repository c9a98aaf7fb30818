//! `ModelRunner`: a model, its KV cache and the sequences living in it. It owns block allocation
//! (each sequence's block table grows as tokens arrive), checks every request before the forward
//! pass (token ids, context length, free blocks), and splits large batches so activations stay bounded.
//! A failed step changes nothing: lengths only advance after the forward pass succeeds.
//! Blocks come from the prefix cache ([`PrefixCache`]): with prefix caching on, a sequence started
//! from a prompt begins on the longest cached chain of its full blocks, and every block a sequence
//! fills is cached as it fills; without it, the cache is just the block pool.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::kv::{CacheStats, KvCache, KvElem, PrefixCache, PrefixMatch, BLOCK_TOKENS, F16};
use crate::pool::Pool;

use super::forward::{Logits, Qwen3Model, SeqChunk};
use super::sequence::Sequence;

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
}

impl KvDtype {
    pub fn parse(name: &str) -> Result<KvDtype> {
        match name {
            // f16 is the default, as in llama.cpp: half the memory and KV bandwidth; f32 is exact.
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "auto" => Ok(KvDtype::F16),
            _ => Err(Error::Value(format!("kv_cache_dtype must be 'auto', 'f16' or 'f32', got {name:?}"))),
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

/// The cache in its element type.
enum KvStore {
    F32(KvCache<f32>),
    F16(KvCache<F16>),
}

impl KvStore {
    fn forward(&mut self, model: &Qwen3Model, batch: &[SeqChunk], pool: &Pool) -> Result<Vec<f32>> {
        match self {
            KvStore::F32(cache) => model.forward(batch, cache, pool),
            KvStore::F16(cache) => model.forward(batch, cache, pool),
        }
    }
}

fn new_store<E: KvElem>(model: &Qwen3Model, num_blocks: usize) -> Result<KvCache<E>> {
    KvCache::new(model.kv_layout(), num_blocks)
}

/// One entry of a step: append `tokens` to sequence `seq` and return the requested logits.
pub struct StepItem<'a> {
    pub seq: u64,
    pub tokens: &'a [u32],
    pub logits: Logits,
}

pub struct ModelRunner {
    model: Qwen3Model,
    kv: KvStore,
    dtype: KvDtype,
    blocks: PrefixCache,
    prefix_caching: bool,
    max_model_len: usize,
    seqs: HashMap<u64, Sequence>,
    next_id: u64,
    computed_tokens: u64,
}

impl ModelRunner {
    pub fn new(model: Qwen3Model, num_blocks: usize, max_model_len: usize, dtype: KvDtype) -> Result<ModelRunner> {
        if max_model_len == 0 || max_model_len > model.config.context_length {
            return Err(Error::Value(format!(
                "max_model_len must be in 1..={} (the model's context length), got {max_model_len}",
                model.config.context_length
            )));
        }
        if num_blocks == 0 {
            return Err(Error::Value("the KV cache needs at least one block".into()));
        }
        let kv = match dtype {
            KvDtype::F32 => KvStore::F32(new_store(&model, num_blocks)?),
            KvDtype::F16 => KvStore::F16(new_store(&model, num_blocks)?),
        };
        let blocks = PrefixCache::new(num_blocks, model.kv_layout().block_bytes(dtype.bytes()));
        Ok(ModelRunner {
            model,
            kv,
            dtype,
            blocks,
            prefix_caching: true,
            max_model_len,
            seqs: HashMap::new(),
            next_id: 0,
            computed_tokens: 0,
        })
    }

    pub fn model(&self) -> &Qwen3Model {
        &self.model
    }

    pub fn kv_dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Bytes of keys and values one block holds over all layers.
    pub fn block_bytes(&self) -> usize {
        self.model.kv_layout().block_bytes(self.dtype.bytes())
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.capacity()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.blocks.num_free()
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Blocks a step can still get: free ones plus cached ones no sequence uses (evicted on demand).
    pub fn num_available_blocks(&self) -> usize {
        self.blocks.num_available()
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Turns prefix caching on or off for sequences started from now on. Turning it off drops every
    /// cached block no sequence uses.
    pub fn set_prefix_caching(&mut self, on: bool) {
        self.prefix_caching = on;
        if !on {
            self.blocks.reset();
        }
    }

    /// Drops every cached block no sequence uses; returns how many.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.blocks.reset()
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.blocks.stats()
    }

    /// Tokens run through the forward pass since the runner was made (prefill and decode).
    pub fn computed_tokens(&self) -> u64 {
        self.computed_tokens
    }

    /// Starts an empty sequence and returns its id. Its blocks are not cached.
    pub fn add_sequence(&mut self) -> u64 {
        self.insert_sequence(Sequence::default())
    }

    /// The cached prefix [`add_sequence_cached`](Self::add_sequence_cached) would start `prompt` on
    /// (empty with caching off). Changes nothing.
    pub fn cached_prefix(&self, prompt: &[u32], salt: Option<&str>) -> PrefixMatch {
        if !self.prefix_caching {
            return PrefixMatch::default();
        }
        self.blocks.lookup(prompt, salt, Self::max_cached_blocks(prompt.len()))
    }

    /// Starts a sequence for `prompt` on the longest cached prefix of its full blocks (with cache salt
    /// `salt`) and returns its id and the number of prompt tokens already in the KV cache; the caller
    /// steps the rest, `prompt[cached..]`. At least the last prompt token is always left to compute,
    /// so the caller gets its logits, and it never lands in a shared block: a prompt of exactly `k`
    /// full blocks reuses at most `k - 1` of them and recomputes the last block (no copy-on-write).
    /// With prefix caching off this is `add_sequence` and 0.
    pub fn add_sequence_cached(&mut self, prompt: &[u32], salt: Option<&str>) -> (u64, usize) {
        if !self.prefix_caching {
            return (self.add_sequence(), 0);
        }
        let m = self.blocks.acquire(prompt, salt, Self::max_cached_blocks(prompt.len()));
        let cached = m.cached_tokens;
        (self.insert_sequence(Sequence::from_prefix(prompt, salt, m)), cached)
    }

    fn max_cached_blocks(prompt_len: usize) -> usize {
        prompt_len.saturating_sub(1) / BLOCK_TOKENS
    }

    fn insert_sequence(&mut self, seq: Sequence) -> u64 {
        self.next_id += 1;
        self.seqs.insert(self.next_id, seq);
        self.next_id
    }

    /// Ends a sequence and gives back its blocks (cached ones stay cached, idle, until evicted).
    pub fn free_sequence(&mut self, seq: u64) -> Result<()> {
        let s = self.seqs.remove(&seq).ok_or_else(|| unknown(seq))?;
        for id in s.block_table {
            self.blocks.release(id)?;
        }
        Ok(())
    }

    /// Tokens of KV the sequence holds.
    pub fn sequence_len(&self, seq: u64) -> Result<usize> {
        Ok(self.seqs.get(&seq).ok_or_else(|| unknown(seq))?.len)
    }

    /// Blocks a sequence of `tokens` tokens occupies.
    pub fn blocks_for(tokens: usize) -> usize {
        tokens.div_ceil(BLOCK_TOKENS)
    }

    /// Blocks for `max_num_seqs` sequences of `max_model_len` tokens, capped by `budget_bytes`, but
    /// never fewer than one full sequence needs.
    pub fn default_blocks(max_model_len: usize, block_bytes: usize, max_num_seqs: usize, budget_bytes: usize) -> usize {
        let per_seq = Self::blocks_for(max_model_len);
        let affordable = budget_bytes / block_bytes.max(1);
        per_seq.max(per_seq.saturating_mul(max_num_seqs).min(affordable))
    }

    /// Appends each item's tokens to its sequence and returns the requested logits rows in item order.
    pub fn step(&mut self, items: &[StepItem], pool: &Pool) -> Result<Vec<f32>> {
        self.check(items)?;
        self.reserve_blocks(items)?;
        let mut logits = Vec::new();
        let mut batch: Vec<SeqChunk> = Vec::new();
        let mut batch_tokens = 0;
        for item in items {
            let seq = &self.seqs[&item.seq];
            let pieces = item.tokens.chunks(MAX_BATCH_TOKENS).collect::<Vec<_>>();
            let mut start = seq.len;
            for (i, piece) in pieces.iter().enumerate() {
                if batch_tokens + piece.len() > MAX_BATCH_TOKENS && !batch.is_empty() {
                    logits.extend(self.kv.forward(&self.model, &batch, pool)?);
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
            logits.extend(self.kv.forward(&self.model, &batch, pool)?);
        }
        for item in items {
            let seq = self.seqs.get_mut(&item.seq).expect("checked");
            let chain = if self.prefix_caching { Some(&mut self.blocks) } else { None };
            seq.append(item.tokens, chain)?;
            self.computed_tokens += item.tokens.len() as u64;
        }
        Ok(logits)
    }

    fn check(&self, items: &[StepItem]) -> Result<()> {
        let vocab = self.model.config.vocab;
        let mut seen = std::collections::HashSet::new();
        for item in items {
            let seq = self.seqs.get(&item.seq).ok_or_else(|| unknown(item.seq))?;
            if !seen.insert(item.seq) {
                return Err(Error::Value(format!("sequence {} appears twice in one step", item.seq)));
            }
            if item.tokens.is_empty() {
                return Err(Error::Value(format!("sequence {}: a step needs at least one token", item.seq)));
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

    /// Grows block tables to cover the new tokens, all or nothing.
    fn reserve_blocks(&mut self, items: &[StepItem]) -> Result<()> {
        let needed: usize = items
            .iter()
            .map(|it| {
                let seq = &self.seqs[&it.seq];
                Self::blocks_for(seq.len + it.tokens.len()).saturating_sub(seq.block_table.len())
            })
            .sum();
        if needed > self.blocks.num_available() {
            return Err(Error::Value(format!(
                "the KV cache is full: this step needs {needed} more blocks, {} of {} are free or evictable",
                self.blocks.num_available(),
                self.blocks.capacity()
            )));
        }
        for it in items {
            let seq = self.seqs.get_mut(&it.seq).expect("checked");
            while seq.block_table.len() < Self::blocks_for(seq.len + it.tokens.len()) {
                // Sequences hold whole cached chains, so every idle cached block can be evicted in turn.
                seq.block_table.push(self.blocks.allocate().expect("counted above"));
            }
        }
        Ok(())
    }
}

fn unknown(seq: u64) -> Error {
    Error::Value(format!("unknown sequence id {seq}"))
}

//! `SequenceTable`: the sequences living in a KV cache and the blocks they hold. It owns block
//! accounting (each sequence's block table grows as tokens arrive, all or nothing per step) and the
//! prefix cache the blocks come from, but no KV data: the model runner pairs it with the cache's
//! memory, and the scheduler's tests and benchmarks use it alone as a ledger.
//! With prefix caching on, a sequence started from a prompt begins on the longest cached chain of
//! its full blocks, and every block a sequence fills is cached as it fills; without it, the cache is
//! just the block pool.

use std::sync::Arc;

use super::{BlockKey, CacheStats, CachedBlock, PrefixCache, PrefixMatch, TierCopies, BLOCK_TOKENS};
use crate::error::{Error, Result};

use super::sequence::Sequence;
use super::sequence_slab::SequenceSlab;

pub struct SequenceTable {
    blocks: PrefixCache,
    prefix_caching: bool,
    seqs: SequenceSlab,
}

/// Tokens of generation a new request's token list and its sequence's block table have room for from
/// the start, so the step loop does not regrow them (a regrowth is a `realloc` and a copy, ~8% of a
/// 64-request scheduler cycle when every request regrew both once). The room is cheap: a token id is 4
/// bytes and a block id 4 per 16 tokens, against ~100 KB of KV per token for Bonsai-1.7B.
pub const GENERATION_ROOM: usize = 256;

/// Blocks a sequence of `tokens` tokens occupies.
pub fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_TOKENS)
}

impl SequenceTable {
    /// A table over `num_blocks` blocks of `block_bytes` bytes each (the size only feeds statistics).
    pub fn new(num_blocks: usize, block_bytes: usize, prefix_caching: bool) -> SequenceTable {
        SequenceTable {
            blocks: PrefixCache::new(num_blocks, block_bytes),
            prefix_caching,
            seqs: SequenceSlab::default(),
        }
    }

    /// A table over `num_blocks` device blocks and `host_blocks` host blocks that idle cached blocks
    /// are demoted to when the device needs room (see [`PrefixCache::with_host_tier`]).
    pub fn with_host_tier(num_blocks: usize, host_blocks: usize, block_bytes: usize, prefix_caching: bool) -> Self {
        SequenceTable {
            blocks: PrefixCache::with_host_tier(num_blocks, host_blocks, block_bytes),
            prefix_caching,
            seqs: SequenceSlab::default(),
        }
    }

    /// The tier copies recorded since the last call; the runner runs them before the step.
    pub fn take_copies(&mut self) -> TierCopies {
        self.blocks.take_copies()
    }

    /// The copies handed out have run; their blocks may be reused.
    pub fn complete_copies(&mut self) -> Result<()> {
        self.blocks.complete_copies()
    }

    pub fn num_host_blocks(&self) -> usize {
        self.blocks.host_capacity()
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

    /// Every block cached on the device, parents first (see [`PrefixCache::cached_blocks`]).
    pub fn cached_blocks(&self) -> Vec<CachedBlock> {
        self.blocks.cached_blocks()
    }

    /// Caches one block in a free block `fill` writes (see [`PrefixCache::restore`]); prefix caching
    /// must be on.
    pub fn restore_block(
        &mut self,
        parent: Option<BlockKey>,
        tokens: &[u32; BLOCK_TOKENS],
        salt: Option<&Arc<str>>,
        fill: impl FnOnce(u32) -> Result<()>,
    ) -> Result<Option<BlockKey>> {
        if !self.prefix_caching {
            return Err(Error::Value("prefix caching is off: cached blocks cannot be restored".into()));
        }
        self.blocks.restore(parent, tokens, salt, fill)
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.blocks.stats()
    }

    pub fn get(&self, seq: u64) -> Result<&Sequence> {
        self.seqs.get(seq).ok_or_else(|| unknown(seq))
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
        self.blocks.lookup(prompt, salt, max_cached_blocks(prompt.len()))
    }

    /// Starts a sequence for `prompt` on the longest cached prefix of its full blocks (with cache salt
    /// `salt`) and returns its id and the number of prompt tokens already in the KV cache; the caller
    /// steps the rest, `prompt[cached..]`. At least the last prompt token is always left to compute,
    /// so the caller gets its logits, and it never lands in a shared block: a prompt of exactly `k`
    /// full blocks reuses at most `k - 1` of them and recomputes the last block (no copy-on-write).
    /// With prefix caching off this is `add_sequence` and 0.
    pub fn add_sequence_cached(&mut self, prompt: &[u32], salt: Option<&str>) -> (u64, usize) {
        let m = self.cached_prefix(prompt, salt);
        self.add_sequence_found(prompt, salt, m)
    }

    /// [`add_sequence_cached`](Self::add_sequence_cached) on the match
    /// [`cached_prefix`](Self::cached_prefix) just returned for the same prompt and salt (the table
    /// unchanged since), without looking the prompt up again.
    pub fn add_sequence_found(&mut self, prompt: &[u32], salt: Option<&str>, m: PrefixMatch) -> (u64, usize) {
        if !self.prefix_caching {
            return (self.insert_sequence(Sequence::for_prompt(prompt.len())), 0);
        }
        let m = self.blocks.acquire_found(prompt.len(), m);
        let cached = m.cached_tokens;
        (self.insert_sequence(Sequence::from_prefix(prompt, salt, m)), cached)
    }

    /// Promotes up to `max_blocks` blocks of `prompt`'s cached prefix that sit in the host tier into
    /// device blocks, ahead of a sequence for it (see [`PrefixCache::prefetch`]); returns how many.
    /// Nothing with caching off or without a host tier.
    pub fn prefetch(&mut self, prompt: &[u32], salt: Option<&str>, max_blocks: usize) -> usize {
        if self.blocks.num_host_cached() == 0 || max_blocks == 0 {
            return 0;
        }
        let m = self.cached_prefix(prompt, salt);
        self.prefetch_found(m, max_blocks)
    }

    /// [`prefetch`](Self::prefetch) on the match [`cached_prefix`](Self::cached_prefix) just returned
    /// (the table unchanged since).
    pub fn prefetch_found(&mut self, m: PrefixMatch, max_blocks: usize) -> usize {
        self.blocks.prefetch(m, max_blocks)
    }

    fn insert_sequence(&mut self, seq: Sequence) -> u64 {
        self.seqs.insert(seq)
    }

    /// A new sequence holding the KV `parent` holds, for a beam that branches off it: the cached full
    /// blocks are shared, each other block (the last, partial one; full ones the cache refused) gets
    /// a fresh block, whose contents the caller copies from the returned `(from, to)` pairs before
    /// either sequence is stepped again. All or nothing: an error (unknown parent, too few blocks)
    /// changes nothing.
    pub fn fork(&mut self, parent: u64) -> Result<(u64, Vec<(u32, u32)>)> {
        let p = self.get(parent)?;
        let held = blocks_for(p.len);
        let shared = if self.prefix_caching { p.cached_blocks().min(held) } else { 0 };
        let (mut table, sources) = (p.block_table[..shared].to_vec(), p.block_table[shared..held].to_vec());
        if sources.len() > self.blocks.num_available() {
            return Err(self.full(sources.len()));
        }
        for &block in &table {
            self.blocks.share(block)?;
        }
        let mut copies = Vec::with_capacity(sources.len());
        for from in sources {
            let to = self.blocks.allocate().expect("counted above");
            table.push(to);
            copies.push((from, to));
        }
        let child = self.get(parent)?.forked(table);
        Ok((self.insert_sequence(child), copies))
    }

    /// Ends a sequence and gives back its blocks (cached ones stay cached, idle, until evicted).
    pub fn free_sequence(&mut self, seq: u64) -> Result<()> {
        let s = self.seqs.remove(seq).ok_or_else(|| unknown(seq))?;
        for id in s.block_table {
            self.blocks.release(id)?;
        }
        Ok(())
    }

    /// Tokens of KV the sequence holds.
    pub fn sequence_len(&self, seq: u64) -> Result<usize> {
        Ok(self.get(seq)?.len)
    }

    /// New blocks sequence `seq` needs to hold `n` more tokens.
    pub fn new_blocks_for(&self, seq: u64, n: usize) -> Result<usize> {
        let s = self.get(seq)?;
        Ok(blocks_for(s.len + n).saturating_sub(s.block_table.len()))
    }

    /// Grows block tables so each `(sequence, n)` can hold `n` more tokens, all or nothing.
    pub fn reserve(&mut self, growth: &[(u64, usize)]) -> Result<()> {
        self.reserve_iter(growth.iter().copied())
    }

    /// [`reserve`](Self::reserve) over an iterator (walked twice: to count, then to grow).
    pub fn reserve_iter<I>(&mut self, growth: I) -> Result<()>
    where
        I: Iterator<Item = (u64, usize)> + Clone,
    {
        self.check_room(growth.clone())?;
        for (seq, n) in growth {
            let s = self.seqs.get_mut(seq).expect("checked");
            while s.block_table.len() < blocks_for(s.len + n) {
                // Sequences hold whole cached chains, so every idle cached block can be evicted in turn.
                s.block_table.push(self.blocks.allocate().expect("counted above"));
            }
        }
        Ok(())
    }

    /// A step's bookkeeping without a model, for a step planned to grow the tables by `new_blocks`
    /// blocks in all (as the scheduler counts them): after checking that many are available, each
    /// `(sequence, tokens, drafts)` is grown for its tokens and [`append`](Self::append)s all but the
    /// last `drafts`, in one visit. A plan that
    /// undercounts fails when the blocks run out, with the sequences before that one advanced.
    pub fn advance_planned<'t, I>(&mut self, new_blocks: usize, steps: I) -> Result<()>
    where
        I: Iterator<Item = (u64, &'t [u32], usize)>,
    {
        if new_blocks > self.blocks.num_available() {
            return Err(self.full(new_blocks));
        }
        for (seq, tokens, drafts) in steps {
            let s = self.seqs.get_mut(seq).ok_or_else(|| unknown(seq))?;
            let (tokens, computed) = (&tokens[..tokens.len() - drafts], tokens.len());
            while s.block_table.len() < blocks_for(s.len + computed) {
                let block = self.blocks.allocate().ok_or_else(|| {
                    Error::Value(format!("the KV cache ran out of blocks in a step planned for {new_blocks}"))
                })?;
                s.block_table.push(block);
            }
            s.append(tokens, if self.prefix_caching { Some(&mut self.blocks) } else { None })?;
        }
        Ok(())
    }

    /// Fails unless every sequence is known and the blocks for all the growth are available.
    fn check_room(&self, growth: impl Iterator<Item = (u64, usize)>) -> Result<()> {
        let mut needed = 0;
        for (seq, n) in growth {
            needed += self.new_blocks_for(seq, n)?;
        }
        if needed > self.blocks.num_available() {
            return Err(self.full(needed));
        }
        Ok(())
    }

    fn full(&self, needed: usize) -> Error {
        Error::Value(format!(
            "the KV cache is full: this step needs {needed} more blocks, {} of {} are free or evictable",
            self.blocks.num_available(),
            self.blocks.capacity()
        ))
    }

    /// Records that `tokens` now hold KV at the end of `seq` (its blocks reserved before), caching
    /// the blocks they filled when prefix caching is on.
    pub fn append(&mut self, seq: u64, tokens: &[u32]) -> Result<()> {
        let s = self.seqs.get_mut(seq).ok_or_else(|| unknown(seq))?;
        let chain = if self.prefix_caching { Some(&mut self.blocks) } else { None };
        s.append(tokens, chain)
    }

    /// Gives back the blocks `seq` holds beyond those its length needs: what a step reserved for
    /// drafted tokens that were rejected. They were never cached (no token of theirs is recorded).
    pub fn release_unused(&mut self, seq: u64) -> Result<()> {
        let s = self.seqs.get_mut(seq).ok_or_else(|| unknown(seq))?;
        while s.block_table.len() > blocks_for(s.len) {
            let block = s.block_table.pop().expect("longer than needed");
            self.blocks.release(block)?;
        }
        Ok(())
    }

    /// Checks the accounting: every sequence holds exactly the blocks its length needs, and the
    /// prefix cache's own invariants hold.
    pub fn check(&self) -> Result<()> {
        self.check_holding(false)
    }

    /// [`check`](Self::check), letting sequences hold blocks reserved for a step not yet recorded
    /// (`reserved`) beyond those their length needs.
    pub fn check_holding(&self, reserved: bool) -> Result<()> {
        for (id, s) in self.seqs.iter() {
            let needed = blocks_for(s.len);
            if s.block_table.len() < needed || (!reserved && s.block_table.len() != needed) {
                return Err(Error::Value(format!(
                    "sequence {id} holds {} blocks for {} tokens",
                    s.block_table.len(),
                    s.len
                )));
            }
        }
        self.blocks.check()
    }
}

fn max_cached_blocks(prompt_len: usize) -> usize {
    prompt_len.saturating_sub(1) / BLOCK_TOKENS
}

fn unknown(seq: u64) -> Error {
    Error::Value(format!("unknown sequence id {seq}"))
}

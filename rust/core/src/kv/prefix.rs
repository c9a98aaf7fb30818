//! `PrefixCache`: the block pool and the block trie together, the one owner of physical KV blocks.
//!
//! Rules: a block is *free* (on the free list), *held* (used by one or more sequences) or *cached and
//! idle* (in the trie, used by none). The trie holds one reference on every cached block, so a cached
//! block's users are its reference count minus one. Only idle cached blocks are evicted, leaves before
//! parents, least recently used first; [`PrefixCache::allocate`] evicts when the free list is empty, so
//! allocation fails only when no block is free or evictable. Callers see [`PrefixMatch`] and block ids,
//! never trie nodes or reference counts. Sequences must hold whole chains (every cached block from the
//! first one on), as the model runner's block tables do; then every idle block is evictable in turn.
//!
//! With a host tier ([`PrefixCache::with_host_tier`]), an idle block that allocation evicts is
//! *demoted* (cached in a host block, its KV copied there) rather than dropped, and a prompt whose
//! chain continues in the host tier *promotes* those blocks back into fresh device blocks when it is
//! acquired, or earlier, while its request still waits ([`PrefixCache::prefetch`]: the blocks are then
//! cached and idle on the device, found there when the request starts). The copies are recorded as
//! [`TierCopies`] for the runner ([`PrefixCache::take_copies`]); a promoted device block keeps an
//! extra reference until [`PrefixCache::complete_copies`], so it is neither evicted nor demoted before
//! its contents arrive.

use std::sync::Arc;

use super::blocks::BlockPool;
use super::cache::BLOCK_TOKENS;
use super::copies::TierCopies;
use super::hash::{BlockKey, SaltTag};
use super::host_tier::HostTier;
use super::trie::{BlockTrie, Evicted, Found, Lookup};
use crate::error::{Error, Result};

/// Blocks whose keys [`PrefixCache::lookup`] hashes before confirming them.
const LOOKAHEAD: usize = 8;

/// The longest cached prefix of a prompt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tokens covered by the cached blocks (a multiple of `BLOCK_TOKENS`).
    pub cached_tokens: usize,
    /// The cached device blocks, in order.
    pub block_ids: Vec<u32>,
    /// The host blocks that continue the chain after them (promoted when acquired).
    pub host_blocks: Vec<u32>,
    /// How many of them no sequence uses yet (acquiring takes them out of the evictable pool).
    pub idle_blocks: usize,
    /// The key of the last cached block: the parent of the next block to insert.
    pub last_key: Option<BlockKey>,
}

/// The outcome of inserting one full block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inserted {
    /// The block is cached under `key`; the caller now holds `block` for this position (its own block,
    /// or the one already cached with the same contents, its own having been released).
    Cached { key: BlockKey, block: u32 },
    /// Not cached (a hash collision, or the parent is no longer cached); the caller keeps its block and
    /// should stop inserting this chain.
    Rejected,
}

/// Counters and gauges of the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompts looked up by `acquire`.
    pub queries: u64,
    /// Those with at least one cached block.
    pub hits: u64,
    pub queried_tokens: u64,
    pub hit_tokens: u64,
    /// Blocks added to the trie.
    pub inserted_blocks: u64,
    pub evictions: u64,
    pub cached_blocks: usize,
    /// Cached blocks no sequence uses.
    pub idle_blocks: usize,
    pub free_blocks: usize,
    pub capacity_blocks: usize,
    /// Bytes of the blocks that hold data (held or cached).
    pub bytes_in_use: usize,
    pub capacity_bytes: usize,
    /// The host tier (all 0 without one): its blocks, the prompt tokens a sequence found there, the
    /// blocks moved each way, those of the promotions made ahead of a waiting request (prefetched:
    /// its tokens are then found on the device) and host entries dropped to make room.
    pub host_capacity_blocks: usize,
    pub host_cached_blocks: usize,
    pub host_free_blocks: usize,
    pub host_hit_tokens: u64,
    pub demotions: u64,
    pub promotions: u64,
    pub prefetched_blocks: u64,
    pub host_evictions: u64,
}

/// The pool of physical blocks with the trie of cached ones.
pub struct PrefixCache {
    pool: BlockPool,
    trie: BlockTrie,
    block_bytes: usize,
    idle: usize,
    tick: u64,
    stats: CacheStats,
    host: Option<HostTier>,
    copies: TierCopies,
    /// Promoted device blocks holding an extra reference until their copies complete.
    promoting: Vec<u32>,
}

impl PrefixCache {
    /// `num_blocks` blocks of `block_bytes` bytes each (the size only feeds the statistics).
    pub fn new(num_blocks: usize, block_bytes: usize) -> PrefixCache {
        PrefixCache {
            pool: BlockPool::new(num_blocks),
            trie: BlockTrie::new(num_blocks),
            block_bytes,
            idle: 0,
            tick: 0,
            stats: CacheStats::default(),
            host: None,
            copies: TierCopies::default(),
            promoting: Vec::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.pool.capacity()
    }

    pub fn num_free(&self) -> usize {
        self.pool.num_free()
    }

    pub fn num_cached(&self) -> usize {
        self.trie.len()
    }

    /// Cached blocks no sequence uses.
    pub fn num_idle(&self) -> usize {
        self.idle
    }

    /// Blocks an allocation can get: free ones plus idle cached ones.
    pub fn num_available(&self) -> usize {
        self.pool.num_free() + self.idle
    }

    /// Sequences (or other holders) using `block`, not counting the trie.
    pub fn users(&self, block: u32) -> u32 {
        if block as usize >= self.capacity() {
            return 0;
        }
        self.pool.ref_count(block) - u32::from(self.is_cached(block))
    }

    pub fn is_cached(&self, block: u32) -> bool {
        self.trie.is_cached(block)
    }

    /// The longest cached chain of full blocks at the start of `tokens`, at most `max_blocks` blocks.
    /// Changes nothing.
    ///
    /// Keys are hashed [`LOOKAHEAD`] blocks at a time, then confirmed: a key depends only on the
    /// previous key, so the map and node reads of a batch overlap instead of each waiting for the
    /// hash before it (a miss wastes at most `LOOKAHEAD - 1` hashes).
    pub fn lookup(&self, tokens: &[u32], salt: Option<&str>, max_blocks: usize) -> PrefixMatch {
        let blocks = (tokens.len() / BLOCK_TOKENS).min(max_blocks);
        // Room for the longest possible match up front (no regrowth as it is found).
        let mut m =
            PrefixMatch { block_ids: Vec::with_capacity(blocks.min(self.trie.len())), ..PrefixMatch::default() };
        let tag = SaltTag::of(salt);
        let block = |i: usize| &tokens[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS];
        let mut keys = [BlockKey::default(); LOOKAHEAD];
        for first in (0..blocks).step_by(LOOKAHEAD) {
            let batch = first..(first + LOOKAHEAD).min(blocks);
            let mut parent = m.last_key;
            for (key, i) in keys.iter_mut().zip(batch.clone()) {
                *key = self.trie.key(parent, block(i), tag);
                parent = Some(*key);
            }
            for (&key, i) in keys.iter().zip(batch) {
                let Lookup::Hit(node) = self.trie.confirm(key, m.last_key, block(i), salt) else {
                    return self.lookup_host(tokens, tag, salt, blocks, m);
                };
                m.block_ids.push(node.block);
                m.idle_blocks += usize::from(node.idle);
                m.cached_tokens += BLOCK_TOKENS;
                m.last_key = Some(key);
            }
        }
        m
    }

    /// Like [`lookup`](Self::lookup), and takes one reference on each matched block for the caller
    /// (who gives them back with [`release`](Self::release)). Counts the query in the statistics.
    pub fn acquire(&mut self, tokens: &[u32], salt: Option<&str>, max_blocks: usize) -> PrefixMatch {
        let m = self.lookup(tokens, salt, max_blocks);
        self.acquire_found(tokens.len(), m)
    }

    /// [`acquire`](Self::acquire) for a match [`lookup`](Self::lookup) just returned for a prompt of
    /// `queried_tokens` tokens, the cache unchanged since: takes its blocks without looking again.
    /// Host blocks of the match are promoted into fresh device blocks (fewer, and the match shorter,
    /// if the device runs out of blocks).
    pub fn acquire_found(&mut self, queried_tokens: usize, mut m: PrefixMatch) -> PrefixMatch {
        self.tick += 1;
        for &block in &m.block_ids {
            self.take(block);
        }
        if !m.host_blocks.is_empty() {
            self.promote(&mut m);
        }
        self.stats.queries += 1;
        self.stats.hits += u64::from(m.cached_tokens > 0);
        self.stats.queried_tokens += queried_tokens as u64;
        self.stats.hit_tokens += m.cached_tokens as u64;
        m
    }

    /// A block for the caller alone (one reference), evicting the least recently used idle leaf when
    /// no block is free; `None` when nothing is free or evictable.
    pub fn allocate(&mut self) -> Option<u32> {
        if self.pool.num_free() == 0 {
            self.evict_one()?;
        }
        self.pool.allocate()
    }

    /// Caches the full block `block`, holding `tokens`, after the chain ending in `parent`. The caller
    /// must hold `block` alone (or pass the block already cached there). If the same contents are
    /// already cached in another block, the caller's reference moves to that block (its own block is
    /// released), so equal prefixes end up sharing one copy.
    pub fn insert(
        &mut self,
        parent: Option<BlockKey>,
        tokens: &[u32],
        salt: Option<&Arc<str>>,
        block: u32,
    ) -> Result<Inserted> {
        let Ok(tokens) = <&[u32; BLOCK_TOKENS]>::try_from(tokens) else {
            return Err(Error::Shape(format!("a cached block holds {BLOCK_TOKENS} tokens, got {}", tokens.len())));
        };
        let parent = match parent {
            None => None,
            Some(p) => match self.trie.block_of(p) {
                Some(b) => Some((p, b)),
                None => {
                    // Evicted: nothing can be cached under it.
                    self.tick += 1;
                    return Ok(Inserted::Rejected);
                }
            },
        };
        self.insert_under(parent, tokens, salt, block)
    }

    /// [`insert`](Self::insert) after a parent known to be cached, with its block.
    fn insert_under(
        &mut self,
        parent: Option<(BlockKey, u32)>,
        tokens: &[u32; BLOCK_TOKENS],
        salt: Option<&Arc<str>>,
        block: u32,
    ) -> Result<Inserted> {
        self.tick += 1;
        // Checked up front (it only reads), raised only where the block must be the caller's alone.
        let sole_holder = self.check_sole_holder(block);
        let pool = &mut self.pool;
        let (key, cached) = match self.trie.find_or_add(parent, tokens, salt, block, self.tick, || {
            sole_holder.clone()?;
            pool.retain(block)
        })? {
            Found::Hit(key, cached) => (key, cached),
            Found::Collision => return Ok(Inserted::Rejected),
            Found::Added(key) => {
                self.stats.inserted_blocks += 1;
                return Ok(Inserted::Cached { key, block });
            }
        };
        if cached != block {
            sole_holder?;
            self.take(cached);
            self.pool.release(block)?;
        } else if self.users(block) == 0 {
            return Err(Error::Value(format!("block {block} is not held")));
        } else {
            self.trie.touch(block, self.tick);
        }
        Ok(Inserted::Cached { key, block: cached })
    }

    /// Caches the full blocks of a chain from the first block on: `blocks[i]` holds
    /// `tokens[16 i..16 (i + 1)]`. Blocks already cached with the same contents replace the caller's
    /// (updated in `blocks`). Returns how many blocks of the chain are now cached. All or nothing:
    /// every block is checked (the cached block of its position, or held by the caller alone) first.
    pub fn insert_chain(&mut self, tokens: &[u32], blocks: &mut [u32], salt: Option<&Arc<str>>) -> Result<usize> {
        if tokens.len() < blocks.len() * BLOCK_TOKENS {
            return Err(Error::Shape(format!(
                "{} blocks need {} tokens, got {}",
                blocks.len(),
                blocks.len() * BLOCK_TOKENS,
                tokens.len()
            )));
        }
        let cached = self.lookup(tokens, salt.map(|s| &**s), blocks.len()).block_ids;
        let mut own = Vec::with_capacity(blocks.len() - cached.len());
        for (i, &b) in blocks.iter().enumerate() {
            if cached.get(i) == Some(&b) {
                if self.users(b) == 0 {
                    return Err(Error::Value(format!("block {b} is not held")));
                }
            } else {
                self.check_sole_holder(b)?;
                own.push(b);
            }
        }
        own.sort_unstable();
        if let Some(w) = own.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::Value(format!("block {} appears twice in one chain", w[0])));
        }
        let mut parent = None;
        for (i, (slot, chunk)) in blocks.iter_mut().zip(tokens.chunks_exact(BLOCK_TOKENS)).enumerate() {
            let chunk = chunk.try_into().expect("a full block");
            match self.insert_under(parent, chunk, salt, *slot)? {
                Inserted::Cached { key, block } => (parent, *slot) = (Some((key, block)), block),
                Inserted::Rejected => return Ok(i),
            }
        }
        Ok(blocks.len())
    }

    /// One more reference on the cached block `block`, which a sequence already holds (a fork of the
    /// sequence shares it); given back with [`release`](Self::release).
    pub fn share(&mut self, block: u32) -> Result<()> {
        if block as usize >= self.capacity() || !self.is_cached(block) || self.users(block) == 0 {
            return Err(Error::Value(format!("block {block} is not a cached block in use")));
        }
        self.tick += 1;
        self.take(block);
        Ok(())
    }

    /// Gives back one reference on `block`. A cached block with no user left becomes idle (evictable
    /// once it is a leaf); any other block with no reference left is free again.
    pub fn release(&mut self, block: u32) -> Result<()> {
        if self.users(block) == 0 {
            return Err(Error::Value(format!("block {block} is not held")));
        }
        self.tick += 1;
        self.pool.release(block)?;
        if self.pool.ref_count(block) == 1 && self.is_cached(block) {
            self.idle += 1;
            self.trie.mark_idle(block, self.tick);
        }
        Ok(())
    }

    /// Evicts up to `n` idle blocks (least recently used leaves first); returns them in order.
    pub fn evict(&mut self, n: usize) -> Vec<u32> {
        let mut blocks = Vec::with_capacity(n.min(self.trie.num_evictable()));
        self.trie.pop_lru_many(n, &mut blocks);
        for &block in &blocks {
            self.pool.release(block).expect("the trie held the block");
        }
        self.idle -= blocks.len();
        self.stats.evictions += blocks.len() as u64;
        blocks
    }

    /// Drops every idle cached block; blocks in use stay cached. Returns how many were dropped.
    pub fn reset(&mut self) -> usize {
        let host = self.host.as_mut().map_or(0, HostTier::reset);
        self.evict(usize::MAX).len() + host
    }

    pub fn stats(&self) -> CacheStats {
        let used = self.capacity() - self.num_free();
        CacheStats {
            cached_blocks: self.trie.len(),
            idle_blocks: self.idle,
            free_blocks: self.num_free(),
            capacity_blocks: self.capacity(),
            bytes_in_use: used * self.block_bytes,
            capacity_bytes: self.capacity() * self.block_bytes,
            ..self.host_stats(self.stats)
        }
    }

    /// Checks every invariant of the pool and the trie; for tests.
    pub fn check(&self) -> Result<()> {
        self.trie.check().map_err(Error::Value)?;
        if let Some(host) = self.host.as_ref() {
            host.check().map_err(Error::Value)?;
        }
        let free = (0..self.capacity() as u32).filter(|&b| self.pool.ref_count(b) == 0).count();
        if free != self.num_free() {
            return Err(Error::Value(format!("{free} blocks have no reference but {} are free", self.num_free())));
        }
        let idle = (0..self.capacity() as u32).filter(|&b| self.is_cached(b) && self.users(b) == 0).count();
        if idle != self.idle {
            return Err(Error::Value(format!("{idle} cached blocks are unused but {} are counted idle", self.idle)));
        }
        Ok(())
    }

    /// Evicts the least recently used idle leaf, demoting it to the host tier when there is one.
    fn evict_one(&mut self) -> Option<u32> {
        let block = match self.host.as_mut() {
            None => self.trie.pop_lru()?,
            Some(host) => {
                let node = self.trie.pop_lru_evicted()?;
                let block = node.block;
                if let Some(host_block) = host.store(node) {
                    self.copies.demote.push([block, host_block]);
                }
                block
            }
        };
        self.pool.release(block).expect("the trie held the block");
        self.idle -= 1;
        self.stats.evictions += 1;
        Some(block)
    }

    /// Takes one reference on the cached block `block` for a caller.
    fn take(&mut self, block: u32) {
        if self.trie.at(block).expect("cached").idle {
            self.idle -= 1;
            self.trie.mark_busy(block, self.tick);
        } else {
            self.trie.touch(block, self.tick);
        }
        self.pool.retain(block).expect("a cached block is allocated");
    }

    fn check_sole_holder(&self, block: u32) -> Result<()> {
        if block as usize >= self.capacity() || self.is_cached(block) || self.users(block) != 1 {
            return Err(Error::Value(format!("block {block} must be held by its caller alone and not cached")));
        }
        Ok(())
    }
}

#[path = "prefix_tiers.rs"]
mod tiers;

#[path = "prefix_export.rs"]
mod export;
pub use export::CachedBlock;

#[cfg(test)]
#[path = "prefix_tests.rs"]
mod tests;

//! `HostTier`: the warm tier of the prefix cache, blocks in host memory that the device tier demoted
//! instead of dropping. It is an index of cached blocks only (no sequence ever uses a host block): a
//! map from [`BlockKey`] to the host block holding it, each entry confirmed by its parent key, tokens
//! and salt as in the device trie, with its own free list and least-recently-used order.
//!
//! A host block is *free*, *cached* (an entry), *demoting* (an entry whose copy in from the device
//! is pending) or *promoting* (its entry taken back to the device, its copy out pending). Pending
//! blocks are never evicted or reused before [`HostTier::complete_copies`]. Entries are evicted
//! leaves first (no cached host block names them as parent), least recently used first, so a chain
//! is dropped from its end and what stays reachable stays whole.

use std::sync::Arc;

use super::blocks::BlockPool;
use super::cache::BLOCK_TOKENS;
use super::hash::{BlockKey, KeyMap};
use super::idle::IdleOrder;
use super::trie::Evicted;

/// One cached host block.
struct Entry {
    key: BlockKey,
    parent: Option<BlockKey>,
    tokens: [u32; BLOCK_TOKENS],
    salt: Option<Arc<str>>,
    last_used: u64,
    /// Its copy in from the device is pending: not evictable yet.
    demoting: bool,
}

/// Counters of the host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostStats {
    pub demotions: u64,
    pub promotions: u64,
    /// Host entries dropped to make room.
    pub evictions: u64,
}

pub struct HostTier {
    pool: BlockPool,
    entries: Vec<Option<Entry>>,
    by_key: KeyMap<u32>,
    /// Host entries naming each key as parent (the parent may live on either tier, or nowhere).
    children: KeyMap<u32>,
    order: IdleOrder,
    /// Blocks with a copy pending this step.
    demoting: Vec<u32>,
    promoting: Vec<u32>,
    tick: u64,
    stats: HostStats,
}

impl HostTier {
    pub fn new(num_blocks: usize) -> HostTier {
        HostTier {
            pool: BlockPool::new(num_blocks),
            entries: std::iter::repeat_with(|| None).take(num_blocks).collect(),
            by_key: KeyMap::with_capacity_and_hasher(num_blocks, Default::default()),
            children: KeyMap::default(),
            order: IdleOrder::new(num_blocks),
            demoting: Vec::new(),
            promoting: Vec::new(),
            tick: 0,
            stats: HostStats::default(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.pool.capacity()
    }

    pub fn num_free(&self) -> usize {
        self.pool.num_free()
    }

    /// Cached host blocks (demoting ones included).
    pub fn num_cached(&self) -> usize {
        self.by_key.len()
    }

    pub fn stats(&self) -> HostStats {
        self.stats
    }

    /// The host block caching `key` if it holds `tokens` after `parent` for `salt`.
    pub fn confirm(&self, key: BlockKey, parent: Option<BlockKey>, tokens: &[u32], salt: Option<&str>) -> Option<u32> {
        let block = *self.by_key.get(&key)?;
        let e = self.entries[block as usize].as_ref().expect("indexed entries exist");
        (e.parent == parent && e.tokens[..] == *tokens && e.salt.as_deref() == salt).then_some(block)
    }

    /// Caches a block the device tier evicted; returns the host block its KV must be copied to, or
    /// `None` when nothing needs copying: the same key is cached here already (a stale duplicate
    /// stays as it is), or every host block is pending or in use as a parent.
    pub fn store(&mut self, node: Evicted) -> Option<u32> {
        self.tick += 1;
        if let Some(&block) = self.by_key.get(&node.key) {
            self.touch(block);
            return None;
        }
        let block = self.pool.allocate().or_else(|| self.evict_one())?;
        if let Some(parent) = node.parent {
            self.add_child(parent);
        }
        let entry = Entry {
            key: node.key,
            parent: node.parent,
            tokens: node.tokens,
            salt: node.salt,
            last_used: self.tick,
            demoting: true,
        };
        self.entries[block as usize] = Some(entry);
        self.by_key.insert(node.key, block);
        self.demoting.push(block);
        self.stats.demotions += 1;
        Some(block)
    }

    /// Takes the entry in `block` back to the device tier: returns what it held; the block stays
    /// allocated (promoting) until [`complete_copies`](Self::complete_copies).
    pub fn take(&mut self, block: u32) -> Evicted {
        let e = self.entries[block as usize].take().expect("a promoted block is cached");
        self.order.remove(block);
        self.by_key.remove(&e.key);
        if let Some(parent) = e.parent {
            self.remove_child(parent);
        }
        self.promoting.push(block);
        self.stats.promotions += 1;
        Evicted { key: e.key, parent: e.parent, tokens: e.tokens, salt: e.salt, block }
    }

    /// The step's copies ran: demoted blocks become evictable, promoted ones free.
    pub fn complete_copies(&mut self) {
        for block in std::mem::take(&mut self.demoting) {
            if let Some(e) = self.entries[block as usize].as_mut() {
                e.demoting = false;
                let (key, tick) = (e.key, e.last_used);
                if self.is_leaf(key) {
                    self.order.insert(block, tick);
                }
            }
        }
        for block in std::mem::take(&mut self.promoting) {
            self.pool.release(block).expect("a promoting block is allocated");
        }
    }

    /// Drops every evictable entry, leaves first, until none is left; returns how many.
    pub fn reset(&mut self) -> usize {
        let mut dropped = 0;
        while self.evict_one().is_some_and(|b| self.pool.release(b).is_ok()) {
            dropped += 1;
        }
        dropped
    }

    /// Checks the tier's bookkeeping; for tests.
    pub fn check(&self) -> Result<(), String> {
        let cached = self.entries.iter().flatten().count();
        if cached != self.by_key.len() {
            return Err(format!("{cached} host entries but {} keys", self.by_key.len()));
        }
        let held = self.capacity() - self.num_free();
        if held != cached + self.promoting.len() {
            return Err(format!("{held} host blocks held, {cached} cached + {} promoting", self.promoting.len()));
        }
        let mut evictable = 0;
        for (block, e) in self.entries.iter().enumerate().filter_map(|(b, e)| Some((b as u32, e.as_ref()?))) {
            if self.by_key.get(&e.key) != Some(&block) {
                return Err(format!("host block {block} is not indexed by its key"));
            }
            let should = !e.demoting && self.is_leaf(e.key);
            if self.order.contains(block) != should {
                return Err(format!("host block {block}: evictable {should} but listed {}", !should));
            }
            evictable += usize::from(should);
        }
        if evictable != self.order.len() {
            return Err(format!("{evictable} evictable host blocks but {} listed", self.order.len()));
        }
        let mut counts: KeyMap<u32> = KeyMap::default();
        for parent in self.entries.iter().flatten().filter_map(|e| e.parent) {
            *counts.entry(parent).or_default() += 1;
        }
        if counts != self.children {
            return Err("host child counts disagree with the entries".into());
        }
        Ok(())
    }

    /// Drops the least recently used evictable entry; returns its block, still allocated.
    fn evict_one(&mut self) -> Option<u32> {
        let block = self.order.pop_first()?;
        let e = self.entries[block as usize].take().expect("listed entries exist");
        self.by_key.remove(&e.key);
        if let Some(parent) = e.parent {
            self.remove_child(parent);
        }
        self.stats.evictions += 1;
        Some(block)
    }

    fn is_leaf(&self, key: BlockKey) -> bool {
        !self.children.contains_key(&key)
    }

    fn touch(&mut self, block: u32) {
        let e = self.entries[block as usize].as_mut().expect("indexed entries exist");
        e.last_used = self.tick;
        if self.order.contains(block) {
            self.order.remove(block);
            self.order.insert(block, self.tick);
        }
    }

    /// A host entry now names `parent`: the parent, if cached here, is no longer a leaf.
    fn add_child(&mut self, parent: BlockKey) {
        *self.children.entry(parent).or_default() += 1;
        if let Some(&pb) = self.by_key.get(&parent) {
            self.order.remove(pb);
        }
    }

    /// A host entry naming `parent` left: the parent, if cached here and idle, may become evictable.
    fn remove_child(&mut self, parent: BlockKey) {
        let count = self.children.get_mut(&parent).expect("counted");
        *count -= 1;
        if *count > 0 {
            return;
        }
        self.children.remove(&parent);
        if let Some(&pb) = self.by_key.get(&parent) {
            let e = self.entries[pb as usize].as_ref().expect("indexed entries exist");
            if !e.demoting {
                self.order.insert(pb, e.last_used);
            }
        }
    }
}

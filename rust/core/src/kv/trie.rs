//! `BlockTrie`: the index of cached full blocks. Each node is one 16-token block, stored in the slot of
//! the physical block that holds its KV, found by its [`BlockKey`] (a map from key to block) and
//! confirmed by its stored parent key, token ids and salt. The trie also keeps the eviction order of
//! the *idle leaves* (no sequence uses the block, no cached child hangs below it), least recently used
//! first ([`IdleOrder`]), so a parent can only be evicted after its children; an eviction costs O(1)
//! and one map removal.
//! The trie never touches reference counts or the free list; [`super::prefix::PrefixCache`] does and
//! tells the trie when a node becomes idle or busy.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;

use super::cache::BLOCK_TOKENS;
use super::hash::{block_key, random_seed, BlockKey, KeyMap, SaltTag};
use super::idle::IdleOrder;

/// No block: a root node's parent.
const NO_BLOCK: u32 = u32::MAX;

/// One cached block (or, in a slot whose block is not cached, the leftovers of an evicted one).
#[derive(Default)]
pub struct Node {
    pub key: BlockKey,
    pub parent: Option<BlockKey>,
    /// The parent's physical block (`NO_BLOCK` for a root).
    parent_block: u32,
    pub tokens: [u32; BLOCK_TOKENS],
    pub salt: Option<Arc<str>>,
    pub block: u32,
    /// Cached blocks whose parent is this one.
    pub children: u32,
    /// Tick of the last acquire, insert or release.
    pub last_used: u64,
    /// No sequence uses the block (only the trie holds it).
    pub idle: bool,
}

impl Node {
    /// The parent's physical block; None for the first block of a chain.
    pub fn parent_block(&self) -> Option<u32> {
        (self.parent_block != NO_BLOCK).then_some(self.parent_block)
    }

    fn evictable(&self) -> bool {
        self.idle && self.children == 0
    }
}

/// An evicted node: its key, chain, contents and the block that held it (now free to reuse).
pub struct Evicted {
    pub key: BlockKey,
    pub parent: Option<BlockKey>,
    pub tokens: [u32; BLOCK_TOKENS],
    pub salt: Option<Arc<str>>,
    pub block: u32,
}

/// What a lookup of one block found.
pub enum Lookup<'a> {
    /// A node with exactly this parent, these tokens and this salt.
    Hit(&'a Node),
    /// No node under this key.
    Miss,
    /// A node under this key holding something else (a hash collision): never served.
    Collision,
}

/// What [`BlockTrie::find_or_add`] found or did.
pub enum Found {
    /// The same block is cached under this key, in this physical block.
    Hit(BlockKey, u32),
    /// Another block is cached under this key (a hash collision): never served, nothing added.
    Collision,
    /// Nothing was cached under this key; the caller's block now is.
    Added(BlockKey),
}

/// Cached blocks by physical block, their keys, and the eviction order.
pub struct BlockTrie {
    seed: u64,
    blocks: KeyMap<u32>,
    /// One slot per physical block, valid where `cached` says so; slots are rewritten field by field,
    /// never moved.
    nodes: Vec<Node>,
    /// Whether each block is cached (compact: releasing a block asks, on the pool's hot path).
    cached: Vec<bool>,
    order: IdleOrder,
}

impl BlockTrie {
    pub fn new(num_blocks: usize) -> BlockTrie {
        BlockTrie {
            seed: random_seed(),
            // Room for every block up front: the map never rehashes as the cache fills.
            blocks: KeyMap::with_capacity_and_hasher(num_blocks, Default::default()),
            nodes: std::iter::repeat_with(Node::default).take(num_blocks).collect(),
            cached: vec![false; num_blocks],
            order: IdleOrder::new(num_blocks),
        }
    }

    /// Every cached block's node, in block order.
    pub fn cached_nodes(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().zip(&self.cached).filter(|(_, &c)| c).map(|(n, _)| n)
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Idle leaves: the blocks that could be evicted right now.
    pub fn num_evictable(&self) -> usize {
        self.order.len()
    }

    /// The node cached in physical block `block`.
    pub fn at(&self, block: u32) -> Option<&Node> {
        self.is_cached(block).then(|| &self.nodes[block as usize])
    }

    pub fn is_cached(&self, block: u32) -> bool {
        self.cached.get(block as usize).copied().unwrap_or(false)
    }

    pub fn key_of(&self, block: u32) -> Option<BlockKey> {
        self.at(block).map(|n| n.key)
    }

    /// The physical block cached under `key`.
    pub fn block_of(&self, key: BlockKey) -> Option<u32> {
        self.blocks.get(&key).copied()
    }

    pub fn node(&self, key: BlockKey) -> Option<&Node> {
        self.at(self.block_of(key)?)
    }

    /// The key of the block holding `tokens` after `parent`, for the salt whose tag is `tag`.
    pub fn key(&self, parent: Option<BlockKey>, tokens: &[u32], tag: SaltTag) -> BlockKey {
        block_key(self.seed, parent, tokens, tag)
    }

    /// What is cached under `key` (from [`key`](Self::key)): the block holding `tokens` after
    /// `parent` for `salt`, nothing, or something else.
    pub fn confirm(&self, key: BlockKey, parent: Option<BlockKey>, tokens: &[u32], salt: Option<&str>) -> Lookup<'_> {
        match self.node(key) {
            None => Lookup::Miss,
            Some(n) if n.parent == parent && n.tokens[..] == *tokens && n.salt.as_deref() == salt => Lookup::Hit(n),
            Some(_) => Lookup::Collision,
        }
    }

    /// Finds the block holding `tokens` after the cached node `parent` (its key and block) for `salt`,
    /// or, when nothing is cached under its key and `admit` agrees, caches it as a busy node in
    /// `block`, last used at `tick` (the parent is no longer a leaf). One probe of the key map.
    pub fn find_or_add<E>(
        &mut self,
        parent: Option<(BlockKey, u32)>,
        tokens: &[u32; BLOCK_TOKENS],
        salt: Option<&Arc<str>>,
        block: u32,
        tick: u64,
        admit: impl FnOnce() -> Result<(), E>,
    ) -> Result<Found, E> {
        let parent_key = parent.map(|p| p.0);
        let salt_text = salt.map(|s| &**s);
        let key = block_key(self.seed, parent_key, tokens, SaltTag::of(salt_text));
        let vacant = match self.blocks.entry(key) {
            Entry::Occupied(e) => {
                let n = &self.nodes[*e.get() as usize];
                let same = n.parent == parent_key && n.tokens == *tokens && n.salt.as_deref() == salt_text;
                return Ok(if same { Found::Hit(key, n.block) } else { Found::Collision });
            }
            Entry::Vacant(v) => v,
        };
        admit()?;
        debug_assert!(!self.cached[block as usize]);
        vacant.insert(block);
        if let Some((_, pb)) = parent {
            debug_assert!(self.cached[pb as usize], "the parent of a new node is cached");
            let node = &mut self.nodes[pb as usize];
            if node.evictable() {
                self.order.remove(pb);
            }
            node.children += 1;
        }
        let node = &mut self.nodes[block as usize];
        node.key = key;
        node.parent = parent_key;
        node.parent_block = parent.map_or(NO_BLOCK, |p| p.1);
        node.tokens = *tokens;
        node.salt = salt.cloned();
        node.block = block;
        node.children = 0;
        node.last_used = tick;
        node.idle = false;
        self.cached[block as usize] = true;
        Ok(Found::Added(key))
    }

    /// A sequence started using the cached block `block`.
    pub fn mark_busy(&mut self, block: u32, tick: u64) {
        debug_assert!(self.cached[block as usize], "cached");
        let node = &mut self.nodes[block as usize];
        if node.evictable() {
            self.order.remove(block);
        }
        node.idle = false;
        node.last_used = tick;
    }

    /// The last sequence using the cached block `block` let it go.
    pub fn mark_idle(&mut self, block: u32, tick: u64) {
        debug_assert!(self.cached[block as usize], "cached");
        let node = &mut self.nodes[block as usize];
        debug_assert!(!node.idle);
        node.idle = true;
        node.last_used = tick;
        if node.evictable() {
            self.order.insert(block, tick);
        }
    }

    /// Records a use of a busy cached block (its place among idle leaves is set when it becomes idle).
    pub fn touch(&mut self, block: u32, tick: u64) {
        debug_assert!(self.cached[block as usize], "cached");
        let node = &mut self.nodes[block as usize];
        debug_assert!(!node.idle);
        node.last_used = tick;
    }

    /// Removes the least recently used idle leaf and returns its block; its parent may become one.
    pub fn pop_lru(&mut self) -> Option<u32> {
        let (key, block, _) = self.take_lru()?;
        self.blocks.remove(&key);
        Some(block)
    }

    /// [`pop_lru`](Self::pop_lru), returning what the node held, so its block can be cached elsewhere.
    pub fn pop_lru_evicted(&mut self) -> Option<Evicted> {
        let (key, block, salt) = self.take_lru()?;
        self.blocks.remove(&key);
        let node = &self.nodes[block as usize];
        Some(Evicted { key, parent: node.parent, tokens: node.tokens, salt, block })
    }

    /// Removes up to `n` idle leaves in eviction order and appends their blocks to `out`.
    pub fn pop_lru_many(&mut self, n: usize, out: &mut Vec<u32>) {
        out.extend((0..n).map_while(|_| self.pop_lru()));
    }

    /// Takes the least recently used idle leaf out of its slot and the eviction order (not the map);
    /// its parent may become an idle leaf.
    fn take_lru(&mut self) -> Option<(BlockKey, u32, Option<Arc<str>>)> {
        let block = self.order.pop_first()?;
        debug_assert!(self.cached[block as usize], "an idle leaf is cached");
        self.cached[block as usize] = false;
        let node = &mut self.nodes[block as usize];
        let (key, parent_block) = (node.key, node.parent_block);
        let salt = node.salt.take();
        if parent_block != NO_BLOCK {
            let parent = &mut self.nodes[parent_block as usize];
            parent.children -= 1;
            if parent.evictable() {
                self.order.insert(parent_block, parent.last_used);
            }
        }
        Some((key, block, salt))
    }

    /// Checks the trie's own bookkeeping (children counts, the key map, the eviction order); for tests.
    pub fn check(&self) -> Result<(), String> {
        let mut children: HashMap<u32, u32> = HashMap::new();
        for (&key, &block) in &self.blocks {
            let Some(n) = self.at(block).filter(|n| n.key == key && n.block == block) else {
                return Err(format!("block {block} is not indexed under its node"));
            };
            if let Some(p) = n.parent {
                if self.block_of(p) != Some(n.parent_block) {
                    return Err(format!("block {block} has an evicted or misfiled parent"));
                }
                *children.entry(n.parent_block).or_default() += 1;
            }
        }
        let nodes = || self.nodes.iter().zip(&self.cached).filter(|(_, &c)| c).map(|(n, _)| n);
        if nodes().count() != self.blocks.len() {
            return Err("the block slots hold nodes that are not indexed".into());
        }
        for n in nodes() {
            if n.children != children.get(&n.block).copied().unwrap_or(0) {
                return Err(format!("block {} counts {} children", n.block, n.children));
            }
            if n.evictable() != self.order.contains(n.block) {
                return Err(format!("block {} is misfiled in the eviction order", n.block));
            }
        }
        self.order.check(nodes().filter(|n| n.evictable()).count())
    }
}

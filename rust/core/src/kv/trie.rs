//! `BlockTrie`: the index of cached full blocks. Each node is one 16-token block, found by its
//! [`BlockKey`] and confirmed by its stored parent key, token ids and salt; it names the physical block
//! that holds its KV. The trie also keeps the eviction order: an ordered set of the *idle leaves* (no
//! sequence uses the block, no cached child hangs below it), least recently used first, so a parent can
//! only be evicted after its children and each eviction costs O(log n).
//! The trie never touches reference counts or the free list; [`super::prefix::PrefixCache`] does and
//! tells the trie when a node becomes idle or busy.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use super::cache::BLOCK_TOKENS;
use super::hash::{block_key, random_seed, BlockKey, KeyMap, SaltTag};

/// One cached block.
pub struct Node {
    pub parent: Option<BlockKey>,
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
    fn lru_entry(&self) -> (u64, u32) {
        (self.last_used, self.block)
    }

    fn evictable(&self) -> bool {
        self.idle && self.children == 0
    }
}

/// What a lookup of one block found.
pub enum Lookup {
    /// A node with exactly this parent, these tokens and this salt.
    Hit(BlockKey),
    /// No node under this key.
    Miss(BlockKey),
    /// A node under this key holding something else (a hash collision): never served.
    Collision,
}

/// Cached blocks by key, by physical block, and in eviction order.
pub struct BlockTrie {
    seed: u64,
    nodes: KeyMap<Node>,
    by_block: Vec<Option<BlockKey>>,
    lru: BTreeSet<(u64, u32)>,
}

impl BlockTrie {
    pub fn new(num_blocks: usize) -> BlockTrie {
        BlockTrie {
            seed: random_seed(),
            // Room for every block up front: the map never rehashes as the cache fills (~140 bytes a block).
            nodes: KeyMap::with_capacity_and_hasher(num_blocks, Default::default()),
            by_block: vec![None; num_blocks],
            lru: BTreeSet::new(),
        }
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Idle leaves: the blocks that could be evicted right now.
    pub fn num_evictable(&self) -> usize {
        self.lru.len()
    }

    pub fn key_of(&self, block: u32) -> Option<BlockKey> {
        self.by_block.get(block as usize).copied().flatten()
    }

    pub fn node(&self, key: BlockKey) -> Option<&Node> {
        self.nodes.get(&key)
    }

    /// Finds the block holding `tokens` after `parent` for `salt` (whose tag is `tag`).
    pub fn lookup(&self, parent: Option<BlockKey>, tokens: &[u32], salt: Option<&str>, tag: SaltTag) -> Lookup {
        let key = block_key(self.seed, parent, tokens, tag);
        match self.nodes.get(&key) {
            None => Lookup::Miss(key),
            Some(n) if n.parent == parent && n.tokens[..] == *tokens && n.salt.as_deref() == salt => Lookup::Hit(key),
            Some(_) => Lookup::Collision,
        }
    }

    /// Adds a busy node under `key`. Its parent, if any, must be cached (and is no longer a leaf).
    pub fn add(&mut self, key: BlockKey, node: Node) {
        debug_assert!(!node.idle && self.by_block[node.block as usize].is_none());
        if let Some(p) = node.parent {
            let parent = self.nodes.get_mut(&p).expect("the parent of a new node is cached");
            if parent.evictable() {
                self.lru.remove(&parent.lru_entry());
            }
            parent.children += 1;
        }
        self.by_block[node.block as usize] = Some(key);
        self.nodes.insert(key, node);
    }

    /// A sequence started using the node's block.
    pub fn mark_busy(&mut self, key: BlockKey, tick: u64) {
        let node = self.nodes.get_mut(&key).expect("cached");
        if node.evictable() {
            self.lru.remove(&node.lru_entry());
        }
        node.idle = false;
        node.last_used = tick;
    }

    /// The last sequence using the node's block let it go.
    pub fn mark_idle(&mut self, key: BlockKey, tick: u64) {
        let node = self.nodes.get_mut(&key).expect("cached");
        debug_assert!(!node.idle);
        node.idle = true;
        node.last_used = tick;
        if node.evictable() {
            self.lru.insert(node.lru_entry());
        }
    }

    /// Records a use of a busy node (its order among idle leaves is set when it becomes idle).
    pub fn touch(&mut self, key: BlockKey, tick: u64) {
        let node = self.nodes.get_mut(&key).expect("cached");
        debug_assert!(!node.idle);
        node.last_used = tick;
    }

    /// Removes the least recently used idle leaf and returns its block; its parent may become one.
    pub fn pop_lru(&mut self) -> Option<u32> {
        let entry = *self.lru.first()?;
        let key = self.by_block[entry.1 as usize].take().expect("an LRU entry is cached");
        let node = self.nodes.remove(&key).expect("cached");
        if let Some(p) = node.parent {
            let parent = self.nodes.get_mut(&p).expect("a cached node's parent is cached");
            parent.children -= 1;
            if parent.evictable() {
                self.lru.insert(parent.lru_entry());
            }
        }
        // Removed after the parent went in: evicting a chain never empties the set, which would free
        // its root node only to allocate a new one for the parent.
        self.lru.remove(&entry);
        Some(entry.1)
    }

    /// Checks the trie's own bookkeeping (children counts, the block index, the LRU set); for tests.
    pub fn check(&self) -> Result<(), String> {
        let mut children: HashMap<BlockKey, u32> = HashMap::new();
        for (key, n) in &self.nodes {
            if self.key_of(n.block) != Some(*key) {
                return Err(format!("block {} is not indexed under its node", n.block));
            }
            if let Some(p) = n.parent {
                if !self.nodes.contains_key(&p) {
                    return Err(format!("block {} has an evicted parent", n.block));
                }
                *children.entry(p).or_default() += 1;
            }
        }
        for (key, n) in &self.nodes {
            if n.children != children.get(key).copied().unwrap_or(0) {
                return Err(format!("block {} counts {} children", n.block, n.children));
            }
            if n.evictable() != self.lru.contains(&n.lru_entry()) {
                return Err(format!("block {} is misfiled in the eviction order", n.block));
            }
        }
        if self.lru.len() != self.nodes.values().filter(|n| n.evictable()).count() {
            return Err("the eviction order holds blocks that are not cached".into());
        }
        if self.by_block.iter().flatten().count() != self.nodes.len() {
            return Err("the block index names blocks that are not cached".into());
        }
        Ok(())
    }
}

//! The prefix cache's contents in and out, for prefix-cache files (`model::cache_file`): every
//! device-tier cached block with its place in its chain, and restoring one block into a free block
//! (never evicting one: what was restored before must stay for the chains that continue from it).

use super::*;
use crate::kv::trie::Node;

/// A cached block as a cache file stores it: the index of its parent among the blocks listed before
/// it (None: the first block of a chain), its tokens and salt, and the physical block holding its KV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedBlock {
    pub parent: Option<usize>,
    pub tokens: [u32; BLOCK_TOKENS],
    pub salt: Option<Arc<str>>,
    pub block: u32,
}

impl PrefixCache {
    /// Every block cached on the device, each after its parent (ordered by depth in its chain, then
    /// by block).
    pub fn cached_blocks(&self) -> Vec<CachedBlock> {
        let nodes: Vec<&Node> = self.trie.cached_nodes().collect();
        let mut depth = vec![None::<u32>; self.capacity()];
        for node in &nodes {
            chain_depth(&self.trie, node.block, &mut depth);
        }
        let mut order = nodes;
        order.sort_by_key(|n| (depth[n.block as usize], n.block));
        let mut index = vec![usize::MAX; self.capacity()];
        order
            .iter()
            .enumerate()
            .map(|(i, n)| {
                index[n.block as usize] = i;
                let parent = n.parent_block().map(|p| index[p as usize]);
                CachedBlock { parent, tokens: n.tokens, salt: n.salt.clone(), block: n.block }
            })
            .collect()
    }

    /// Caches `tokens` after the chain ending in `parent` in a free block that `fill` writes the KV
    /// of first; the block is left idle. Returns its key, or None where nothing was cached: no block is
    /// free, the parent is not cached, or a different block holds the key (a collision). The same
    /// contents already cached stay where they are (the new block goes back to the free list).
    pub fn restore(
        &mut self,
        parent: Option<BlockKey>,
        tokens: &[u32; BLOCK_TOKENS],
        salt: Option<&Arc<str>>,
        fill: impl FnOnce(u32) -> Result<()>,
    ) -> Result<Option<BlockKey>> {
        let key = self.trie.key(parent, tokens, SaltTag::of(salt.map(|s| &**s)));
        if let Lookup::Hit(_) = self.trie.confirm(key, parent, tokens, salt.map(|s| &**s)) {
            return Ok(Some(key)); // cached already: nothing to fill, no block needed
        }
        let Some(block) = self.pool.allocate() else { return Ok(None) };
        if let Err(e) = fill(block) {
            self.pool.release(block)?;
            return Err(e);
        }
        match self.insert(parent, tokens, salt, block)? {
            Inserted::Cached { key, block } => {
                self.release(block)?;
                Ok(Some(key))
            }
            Inserted::Rejected => {
                self.release(block)?;
                Ok(None)
            }
        }
    }
}

/// The depth of `block` in its chain (0: the first block), memoized in `depth`. Iterative: a chain
/// is as long as the longest cached prompt, thousands of blocks.
fn chain_depth(trie: &BlockTrie, block: u32, depth: &mut [Option<u32>]) -> u32 {
    let mut unknown = Vec::new();
    let mut at = Some(block);
    let mut known = None; // the depth of the first ancestor whose depth is known
    while let Some(b) = at {
        if let Some(d) = depth[b as usize] {
            known = Some(d);
            break;
        }
        unknown.push(b);
        at = trie.at(b).and_then(Node::parent_block);
    }
    for (d, &b) in (known.map_or(0, |d| d + 1)..).zip(unknown.iter().rev()) {
        depth[b as usize] = Some(d);
    }
    depth[block as usize].expect("set above")
}

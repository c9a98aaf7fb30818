//! The host tier's side of [`PrefixCache`]: building a cache with one, continuing a lookup there,
//! promoting matched host blocks into device blocks, the step's copy lists and their completion, and
//! the tier's statistics. (Demotion happens where the device tier evicts, in `evict_one`.)

use super::*;

impl PrefixCache {
    /// A cache over `num_blocks` device blocks whose evicted blocks are demoted to `host_blocks` host
    /// blocks (none: no host tier).
    pub fn with_host_tier(num_blocks: usize, host_blocks: usize, block_bytes: usize) -> PrefixCache {
        let mut cache = PrefixCache::new(num_blocks, block_bytes);
        cache.host = (host_blocks > 0).then(|| HostTier::new(host_blocks));
        cache
    }

    pub fn host_capacity(&self) -> usize {
        self.host.as_ref().map_or(0, HostTier::capacity)
    }

    /// The copies recorded since the last call, for the runner to execute before its forward pass.
    pub fn take_copies(&mut self) -> TierCopies {
        std::mem::take(&mut self.copies)
    }

    /// The copies handed out by [`take_copies`](Self::take_copies) have run: the blocks they read or
    /// wrote may be reused, evicted or demoted again.
    pub fn complete_copies(&mut self) -> Result<()> {
        if let Some(host) = self.host.as_mut() {
            host.complete_copies();
        }
        for block in std::mem::take(&mut self.promoting) {
            self.release(block)?;
        }
        Ok(())
    }

    /// Continues a device match `m` (which stopped short of `blocks`) in the host tier.
    pub(super) fn lookup_host(
        &self,
        tokens: &[u32],
        tag: SaltTag,
        salt: Option<&str>,
        blocks: usize,
        mut m: PrefixMatch,
    ) -> PrefixMatch {
        let Some(host) = self.host.as_ref() else { return m };
        for i in m.block_ids.len()..blocks {
            let block = &tokens[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS];
            let key = self.trie.key(m.last_key, block, tag);
            let Some(found) = host.confirm(key, m.last_key, block, salt) else { break };
            m.host_blocks.push(found);
            m.cached_tokens += BLOCK_TOKENS;
            m.last_key = Some(key);
        }
        m
    }

    /// Moves the host blocks of an acquired match into device blocks the caller holds, recording the
    /// copies. Every host entry is taken first, so demotions that make room cannot evict them.
    pub(super) fn promote(&mut self, m: &mut PrefixMatch) {
        let host = self.host.as_mut().expect("host blocks come from the host tier");
        let taken: Vec<Evicted> = m.host_blocks.drain(..).map(|b| host.take(b)).collect();
        // The chain continues from the last device block (`m.last_key` is the last host block's key).
        let mut parent = m.block_ids.last().map(|&b| (self.trie.key_of(b).expect("cached"), b));
        for node in taken {
            let Some(block) = self.allocate() else { break };
            let inserted = self.insert_under(parent, &node.tokens, node.salt.as_ref(), block);
            let Ok(Inserted::Cached { key, block }) = inserted else {
                self.pool.release(block).expect("allocated above");
                break;
            };
            debug_assert_eq!(key, node.key, "both tiers hash with the trie's seed");
            self.pool.retain(block).expect("held by the caller");
            self.promoting.push(block);
            self.copies.promote.push([node.block, block]);
            self.stats.host_hit_tokens += BLOCK_TOKENS as u64;
            m.block_ids.push(block);
            parent = Some((key, block));
        }
        m.cached_tokens = m.block_ids.len() * BLOCK_TOKENS;
        m.last_key = parent.map(|p| p.0);
    }

    pub(super) fn host_stats(&self, stats: CacheStats) -> CacheStats {
        let Some(host) = self.host.as_ref() else { return stats };
        let s = host.stats();
        CacheStats {
            host_capacity_blocks: host.capacity(),
            host_cached_blocks: host.num_cached(),
            host_free_blocks: host.num_free(),
            demotions: s.demotions,
            promotions: s.promotions,
            host_evictions: s.evictions,
            ..stats
        }
    }
}

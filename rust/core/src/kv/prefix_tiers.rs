//! The host tier's side of [`PrefixCache`]: building a cache with one, continuing a lookup there,
//! promoting matched host blocks into device blocks (for a sequence acquiring them, or ahead of one:
//! a prefetch), the step's copy lists and their completion, and the tier's statistics. (Demotion
//! happens where the device tier evicts, in `evict_one`.)

use super::*;

/// Who holds blocks promoted from the host tier besides the trie and the pending copy.
#[derive(Clone, Copy)]
enum Holder {
    /// The sequence acquiring the match.
    Sequence,
    /// Nobody: the blocks are idle once their copies complete.
    None,
}

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

    /// Blocks cached in the host tier (0 without one).
    pub fn num_host_cached(&self) -> usize {
        self.host.as_ref().map_or(0, HostTier::num_cached)
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
    /// copies as promotions.
    pub(super) fn promote(&mut self, m: &mut PrefixMatch) {
        let count = m.host_blocks.len();
        self.promote_chain(m, count, Holder::Sequence);
    }

    /// Promotes host blocks of `m`, a match no sequence acquires (a waiting request's prefix, just
    /// looked up), into device blocks that are cached and idle once the copies complete, recording
    /// the copies as prefetches. Until then the match's device blocks are held too (a cached block
    /// with a held child is not evictable, so counting it available would overcount), and the
    /// prefetch makes at most `max_blocks` blocks unavailable in all: that many, less the match's idle
    /// device blocks, are promoted. Returns how many blocks were promoted (fewer if the device runs
    /// out of blocks).
    pub fn prefetch(&mut self, mut m: PrefixMatch, max_blocks: usize) -> usize {
        let room = max_blocks.saturating_sub(m.idle_blocks);
        if m.host_blocks.is_empty() || room == 0 {
            return 0;
        }
        self.tick += 1;
        for &block in &m.block_ids {
            self.take(block);
            self.promoting.push(block);
        }
        let on_device = m.block_ids.len();
        self.promote_chain(&mut m, room, Holder::None);
        m.block_ids.len() - on_device
    }

    /// Takes the first `count` host blocks of `m` out of the host tier (all before any allocation, so
    /// demotions that make room cannot evict them) and caches them in fresh device blocks after `m`'s
    /// device blocks, each kept from eviction until the copies complete. `holder` says whether a
    /// sequence holds them too (a promotion) or none does (a prefetch).
    fn promote_chain(&mut self, m: &mut PrefixMatch, count: usize, holder: Holder) {
        let host = self.host.as_mut().expect("host blocks come from the host tier");
        let count = count.min(m.host_blocks.len());
        let taken: Vec<Evicted> = m.host_blocks.drain(..count).map(|b| host.take(b)).collect();
        m.host_blocks.clear();
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
            let pair = [node.block, block];
            match holder {
                Holder::Sequence => {
                    self.pool.retain(block).expect("held by the caller");
                    self.copies.promote.push(pair);
                    self.stats.host_hit_tokens += BLOCK_TOKENS as u64;
                }
                Holder::None => {
                    self.copies.prefetch.push(pair);
                    self.stats.prefetched_blocks += 1;
                }
            }
            // Released when the copies complete: the sequence's extra reference taken above, or for a
            // prefetch the allocation's own.
            self.promoting.push(block);
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

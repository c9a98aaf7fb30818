//! The paged KV cache: fixed-size physical blocks of keys and values for every layer
//! ([`cache::KvCache`]), the allocator that hands them out ([`blocks::BlockPool`]), and block tables
//! mapping a sequence's positions to physical blocks. A block id names the same slot range in every
//! layer, so sharing a block (the prefix cache) shares it for the whole model. The prefix cache
//! ([`prefix::PrefixCache`]) owns the pool and the trie of cached full blocks ([`trie::BlockTrie`],
//! keyed by [`hash::BlockKey`], its idle leaves in eviction order in [`idle::IdleOrder`]). The
//! [`SequenceTable`] keeps the sequences living in the cache and their block tables; the scheduler
//! plans over it and runners read it, so this module never depends on a model.

pub mod blocks;
pub mod cache;
pub mod copies;
pub mod elem;
#[cfg(test)]
mod fork_tests;
pub mod hash;
pub mod host_tier;
pub mod idle;
pub mod prefix;
pub mod sequence;
mod sequence_slab;
pub mod sequence_table;
pub mod trie;

pub use blocks::BlockPool;
pub use cache::{KvCache, KvLayout, BLOCK_TOKENS};
pub use copies::TierCopies;
pub use elem::{inverse_scale, KvElem, F16, I8};
pub use hash::BlockKey;
pub use prefix::{CacheStats, CachedBlock, Inserted, PrefixCache, PrefixMatch};
pub use sequence_table::{blocks_for, SequenceTable, GENERATION_ROOM};

//! The paged KV cache: fixed-size physical blocks of keys and values for every layer
//! ([`cache::KvCache`]), the allocator that hands them out ([`blocks::BlockPool`]), and block tables
//! mapping a sequence's positions to physical blocks. A block id names the same slot range in every
//! layer, so sharing a block (the prefix cache) shares it for the whole model. The prefix cache
//! ([`prefix::PrefixCache`]) owns the pool and the trie of cached full blocks ([`trie::BlockTrie`],
//! keyed by [`hash::BlockKey`], its idle leaves in eviction order in [`idle::IdleOrder`]).

pub mod blocks;
pub mod cache;
pub mod elem;
pub mod hash;
pub mod idle;
pub mod prefix;
pub mod trie;

pub use blocks::BlockPool;
pub use cache::{KvCache, KvLayout, BLOCK_TOKENS};
pub use elem::{KvElem, F16};
pub use hash::BlockKey;
pub use prefix::{CacheStats, Inserted, PrefixCache, PrefixMatch};

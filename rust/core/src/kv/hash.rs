//! `BlockKey`: the 128-bit identity of a full KV block in the prefix trie, xxh3-128 of its token ids,
//! its parent's key and the cache salt, seeded per cache with a random seed (so nobody can aim
//! prompts at one bucket of the trie's map). The key only finds a candidate; the trie confirms every
//! hit by comparing the stored parent, tokens and salt, so a collision can never serve another
//! prompt's KV. Keys are already uniform, so the trie's map hashes them by folding, not by SipHash.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::{xxh3_128, xxh3_128_with_seed};

use super::cache::BLOCK_TOKENS;

/// The key of one full block: a hash of everything the block's KV depends on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u128);

/// The cache salt as it enters keys: 0 for none, an odd hash of the text otherwise (so `None` and
/// `Some("")` differ). Computed once per lookup, not once per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SaltTag(u128);

impl SaltTag {
    pub fn of(salt: Option<&str>) -> SaltTag {
        SaltTag(salt.map_or(0, |s| xxh3_128(s.as_bytes()) | 1))
    }
}

/// A random seed for one cache's keys.
pub fn random_seed() -> u64 {
    RandomState::new().hash_one(0u8)
}

/// The key of the block holding `tokens` (at most one block's worth) after the chain ending in
/// `parent` (`None`: the first block). One hash over a stack buffer: tokens, parent, salt, then a word
/// with the parent flag and the count. Every field is written whole at an 8-byte-aligned offset, so
/// the hash's 8-byte reads are each served by one earlier store (reads spanning two stores stall).
pub fn block_key(seed: u64, parent: Option<BlockKey>, tokens: &[u32], salt: SaltTag) -> BlockKey {
    assert!(tokens.len() <= BLOCK_TOKENS, "a block holds at most {BLOCK_TOKENS} tokens");
    let mut buf = [0u8; 4 * BLOCK_TOKENS + 40];
    let n = 4 * tokens.len();
    for (dst, t) in buf[..n].chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    let at = n.next_multiple_of(8);
    buf[at..at + 16].copy_from_slice(&parent.map_or(0, |p| p.0).to_le_bytes());
    buf[at + 16..at + 32].copy_from_slice(&salt.0.to_le_bytes());
    let flags = u64::from(parent.is_some()) | (tokens.len() as u64) << 8;
    buf[at + 32..at + 40].copy_from_slice(&flags.to_le_bytes());
    BlockKey(xxh3_128_with_seed(&buf[..at + 40], seed))
}

/// The keys of the full blocks at the start of `tokens`, each chained on the one before, as the
/// prefix trie computes them for a cache seeded with `seed` (a router outside the cache uses its own
/// seed: keys from different seeds never match).
pub fn chain_keys(seed: u64, tokens: &[u32], salt: Option<&str>) -> Vec<BlockKey> {
    let tag = SaltTag::of(salt);
    let mut parent = None;
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let key = block_key(seed, parent, block, tag);
            parent = Some(key);
            key
        })
        .collect()
}

/// Hashes a [`BlockKey`] for a map by folding its halves (the key is already a strong hash).
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(word);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by block keys.
pub type KeyMap<V> = HashMap<BlockKey, V, BuildHasherDefault<KeyHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_keys_are_the_tries_keys_for_full_blocks_only() {
        let tokens: Vec<u32> = (0..40).collect();
        let keys = chain_keys(7, &tokens, Some("tenant"));
        let tag = SaltTag::of(Some("tenant"));
        let first = block_key(7, None, &tokens[..16], tag);
        assert_eq!(keys, vec![first, block_key(7, Some(first), &tokens[16..32], tag)]);
        assert_ne!(chain_keys(7, &tokens, None), keys);
        assert_ne!(chain_keys(8, &tokens, Some("tenant")), keys);
    }

    #[test]
    fn every_input_changes_the_key() {
        let t: Vec<u32> = (0..16).collect();
        let none = SaltTag::of(None);
        let base = block_key(7, None, &t, none);
        assert_eq!(base, block_key(7, None, &t, none));
        assert_ne!(base, block_key(8, None, &t, none));
        let mut t2 = t.clone();
        t2[15] = 99;
        assert_ne!(base, block_key(7, None, &t2, none));
        assert_ne!(base, block_key(7, None, &t[..15], none));
        assert_ne!(base, block_key(7, Some(base), &t, none));
        assert_ne!(base, block_key(7, Some(BlockKey(0)), &t, none));
        assert_ne!(base, block_key(7, None, &t, SaltTag::of(Some(""))));
        assert_ne!(block_key(7, None, &t, SaltTag::of(Some("a"))), block_key(7, None, &t, SaltTag::of(Some("b"))));
    }
}

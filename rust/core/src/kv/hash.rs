//! `BlockKey`: the 128-bit identity of a full KV block in the prefix trie, xxh3-128 of its parent's
//! key, its token ids and the cache salt. The key only finds a candidate; the trie confirms every hit by
//! comparing the stored parent, tokens and salt, so a collision can never serve another prompt's KV.

use xxhash_rust::xxh3::Xxh3;

/// The key of one full block: a hash of everything the block's KV depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u128);

/// The key of the block holding `tokens` after the chain ending in `parent` (`None`: the first block),
/// for requests with cache salt `salt`. Every field is length- or tag-prefixed, so distinct inputs never
/// serialise to the same bytes (`None` and `Some("")` differ, as do a parent and no parent).
pub fn block_key(parent: Option<BlockKey>, tokens: &[u32], salt: Option<&str>) -> BlockKey {
    let mut h = Xxh3::new();
    match parent {
        Some(BlockKey(p)) => {
            h.update(&[1]);
            h.update(&p.to_le_bytes());
        }
        None => h.update(&[0]),
    }
    match salt {
        Some(s) => {
            h.update(&[1]);
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        None => h.update(&[0]),
    }
    h.update(&(tokens.len() as u64).to_le_bytes());
    // Tokens go in 16 at a time: one update per block, not one per token.
    let mut buf = [0u8; 64];
    for chunk in tokens.chunks(16) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..4 * chunk.len()]);
    }
    BlockKey(h.digest128())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_input_changes_the_key() {
        let t: Vec<u32> = (0..16).collect();
        let base = block_key(None, &t, None);
        assert_eq!(base, block_key(None, &t, None));
        let mut t2 = t.clone();
        t2[15] = 99;
        assert_ne!(base, block_key(None, &t2, None));
        assert_ne!(base, block_key(Some(base), &t, None));
        assert_ne!(base, block_key(None, &t, Some("")));
        assert_ne!(block_key(None, &t, Some("a")), block_key(None, &t, Some("b")));
    }
}

//! `Sequence`: one sequence of the model runner: how many positions hold KV and where (its block
//! table), and, when it takes part in prefix caching, the token ids behind that KV and how far its
//! chain of full blocks is cached. It never allocates blocks; the runner does, through the cache.

use std::sync::Arc;

use super::{BlockKey, Inserted, PrefixCache, PrefixMatch, BLOCK_TOKENS};
use crate::error::Result;

use super::sequence_table::{blocks_for, GENERATION_ROOM};

/// A sequence's KV: position `p` lives in `block_table[p / 16]`, slot `p % 16`. The chain is boxed
/// so that a sequence is 40 bytes: a step over many sequences reads their lengths and block tables
/// from a few cache lines.
#[derive(Default)]
pub struct Sequence {
    pub len: usize,
    pub block_table: Vec<u32>,
    pub chain: Option<Box<CachedChain>>,
}

const _: () = assert!(std::mem::size_of::<Sequence>() == 40);

/// What prefix caching needs to know about a sequence.
pub struct CachedChain {
    salt: Option<Arc<str>>,
    /// The token ids of positions `0..len`.
    tokens: Vec<u32>,
    /// The key of the last cached block of the chain, and how many blocks are cached.
    last_key: Option<BlockKey>,
    cached_blocks: usize,
    /// A block was refused (a hash collision): nothing after it is cached.
    stopped: bool,
}

impl Sequence {
    /// A sequence that starts on a cached prefix `m` of `prompt` (its blocks already acquired).
    pub fn from_prefix(prompt: &[u32], salt: Option<&str>, m: PrefixMatch) -> Sequence {
        let chain = CachedChain {
            salt: salt.map(Arc::from),
            tokens: with_room(&prompt[..m.cached_tokens], prompt.len() - m.cached_tokens + GENERATION_ROOM),
            last_key: m.last_key,
            cached_blocks: m.block_ids.len(),
            stopped: false,
        };
        let block_table = table_for_prompt(prompt.len(), m.block_ids);
        Sequence { len: m.cached_tokens, block_table, chain: Some(Box::new(chain)) }
    }

    /// A sequence that caches nothing, for a prompt of `prompt_len` tokens.
    pub fn for_prompt(prompt_len: usize) -> Sequence {
        Sequence { block_table: table_for_prompt(prompt_len, Vec::new()), ..Sequence::default() }
    }

    /// Records that `tokens` now hold KV at the end of the sequence and, given the cache, caches every
    /// block they filled. A block whose contents are already cached is swapped for the cached copy.
    #[inline]
    pub fn append(&mut self, tokens: &[u32], cache: Option<&mut PrefixCache>) -> Result<()> {
        self.len += tokens.len();
        if self.chain.is_none() {
            return Ok(());
        }
        self.append_to_chain(tokens, cache)
    }

    /// [`append`](Self::append)'s work for a sequence that takes part in prefix caching (`len`
    /// already counts `tokens`).
    fn append_to_chain(&mut self, tokens: &[u32], cache: Option<&mut PrefixCache>) -> Result<()> {
        let Some(chain) = self.chain.as_mut() else { return Ok(()) };
        chain.tokens.extend_from_slice(tokens);
        let Some(cache) = cache else {
            // Caching was turned off while the sequence ran: it caches nothing more.
            chain.stopped = true;
            return Ok(());
        };
        while !chain.stopped && chain.cached_blocks < self.len / BLOCK_TOKENS {
            let i = chain.cached_blocks;
            let block_tokens = &chain.tokens[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS];
            match cache.insert(chain.last_key, block_tokens, chain.salt.as_ref(), self.block_table[i])? {
                Inserted::Cached { key, block } => {
                    self.block_table[i] = block;
                    chain.last_key = Some(key);
                    chain.cached_blocks += 1;
                }
                Inserted::Rejected => chain.stopped = true,
            }
        }
        Ok(())
    }
}

impl Sequence {
    /// Leading blocks of the sequence that sit in the prefix cache (a fork shares them).
    pub fn cached_blocks(&self) -> usize {
        self.chain.as_ref().map_or(0, |c| c.cached_blocks)
    }

    /// This sequence's bookkeeping over `block_table` (its cached blocks first, then copies of the
    /// rest): the same length, token ids and cached chain, with room to grow.
    pub fn forked(&self, block_table: Vec<u32>) -> Sequence {
        let chain = self.chain.as_ref().map(|c| {
            Box::new(CachedChain {
                salt: c.salt.clone(),
                tokens: with_room(&c.tokens, GENERATION_ROOM),
                last_key: c.last_key,
                cached_blocks: c.cached_blocks,
                stopped: c.stopped,
            })
        });
        Sequence { len: self.len, block_table, chain }
    }
}

/// A block table starting with `blocks`, with room for a prompt of `prompt_len` tokens and
/// [`GENERATION_ROOM`] generated ones: no regrowth before then.
fn table_for_prompt(prompt_len: usize, mut blocks: Vec<u32>) -> Vec<u32> {
    blocks.reserve(blocks_for(prompt_len + GENERATION_ROOM).saturating_sub(blocks.len()));
    blocks
}

/// `tokens` in a list with room for `room` more.
fn with_room(tokens: &[u32], room: usize) -> Vec<u32> {
    let mut list = Vec::with_capacity(tokens.len() + room);
    list.extend_from_slice(tokens);
    list
}

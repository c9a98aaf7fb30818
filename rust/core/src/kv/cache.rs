//! `KvCache`: the bytes of the paged KV cache. Storage is `[layer][block][kv_head]` then, for values,
//! `[slot][dim]` and, for keys, transposed `[dim][slot]`: attention scores a whole block of 16 keys
//! with 16-wide vector multiply-adds (no horizontal sums), and sums values row by row.
//! The cache never decides which block a token goes to: callers pass block ids from a block table.
//! The element type is a parameter ([`KvElem`]: f32 or f16).

use super::elem::KvElem;
use crate::error::{Error, Result};
use crate::huge::{as_bytes, as_bytes_mut, HugeBuf};

/// Tokens per physical block.
pub const BLOCK_TOKENS: usize = 16;

/// The dimensions the cache is laid out by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// f32 values of one head in one block.
    fn head_block(&self) -> usize {
        BLOCK_TOKENS * self.head_dim
    }

    /// f32 values of one block in one layer (all heads).
    fn layer_block(&self) -> usize {
        self.n_kv_heads * self.head_block()
    }

    /// Bytes of keys and values one block holds over all layers, with `elem_bytes` per value.
    pub fn block_bytes(&self, elem_bytes: usize) -> usize {
        2 * self.n_layers * self.layer_block() * elem_bytes
    }
}

/// Keys and values for `num_blocks` physical blocks of every layer.
pub struct KvCache<E: KvElem> {
    layout: KvLayout,
    num_blocks: usize,
    keys: HugeBuf<E>,
    values: HugeBuf<E>,
}

impl<E: KvElem> KvCache<E> {
    /// Reserves the cache zeroed. A large cache is an anonymous mapping with huge pages requested
    /// ([`HugeBuf`]), committed only as blocks are first written: it costs nothing until it is used.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Result<KvCache<E>> {
        let len = layout
            .layer_block()
            .checked_mul(layout.n_layers)
            .and_then(|v| v.checked_mul(num_blocks))
            .ok_or_else(|| Error::Value(format!("a KV cache of {num_blocks} blocks does not fit in memory")))?;
        let fail = || {
            Error::Value(format!(
                "cannot allocate a KV cache of {num_blocks} blocks ({} bytes)",
                num_blocks.saturating_mul(layout.block_bytes(std::mem::size_of::<E>()))
            ))
        };
        let keys = HugeBuf::zeroed(len).ok_or_else(fail)?;
        let values = HugeBuf::zeroed(len).ok_or_else(fail)?;
        Ok(KvCache { layout, num_blocks, keys, values })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn head_offset(&self, layer: usize, block: usize, head: usize) -> usize {
        assert!(layer < self.layout.n_layers && block < self.num_blocks && head < self.layout.n_kv_heads);
        ((layer * self.num_blocks + block) * self.layout.n_kv_heads + head) * self.layout.head_block()
    }

    /// Stores one token's keys and values (all KV heads, `kv_dim` values each) at `slot` of `block`.
    pub fn write(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.layout.head_dim;
        assert!(slot < BLOCK_TOKENS && k.len() == self.layout.n_kv_heads * d && v.len() == k.len());
        for head in 0..self.layout.n_kv_heads {
            let at = self.head_offset(layer, block, head) + slot * d;
            let (k_head, v_head) = (&k[head * d..(head + 1) * d], &v[head * d..(head + 1) * d]);
            E::store(v_head, &mut self.values[at..at + d]);
            let key_block = at - slot * d;
            for (i, &x) in k_head.iter().enumerate() {
                self.keys[key_block + i * BLOCK_TOKENS + slot] = E::from_f32(x);
            }
        }
    }

    /// Appends the raw bytes of `block` to `out`: each layer's keys then values, in storage layout
    /// (`layout.block_bytes(size_of::<E>())` bytes). A cache file's block record.
    pub fn read_block(&self, block: usize, out: &mut Vec<u8>) {
        let n = self.layout.layer_block();
        for layer in 0..self.layout.n_layers {
            let at = self.head_offset(layer, block, 0);
            out.extend_from_slice(as_bytes(&self.keys[at..at + n]));
            out.extend_from_slice(as_bytes(&self.values[at..at + n]));
        }
    }

    /// Overwrites `block` with bytes [`read_block`](Self::read_block) gave (of a cache with the same
    /// layout and element type).
    pub fn write_block(&mut self, block: usize, bytes: &[u8]) -> Result<()> {
        let want = self.layout.block_bytes(std::mem::size_of::<E>());
        if bytes.len() != want {
            return Err(Error::Shape(format!("a KV block holds {want} bytes, got {}", bytes.len())));
        }
        let n = self.layout.layer_block();
        let half = n * std::mem::size_of::<E>();
        for (layer, chunk) in bytes.chunks_exact(2 * half).enumerate() {
            let at = self.head_offset(layer, block, 0);
            as_bytes_mut(&mut self.keys[at..at + n]).copy_from_slice(&chunk[..half]);
            as_bytes_mut(&mut self.values[at..at + n]).copy_from_slice(&chunk[half..]);
        }
        Ok(())
    }

    /// The keys of one head in one block, transposed: `head_dim` rows of `BLOCK_TOKENS`.
    pub fn keys(&self, layer: usize, block: usize, head: usize) -> &[E] {
        let at = self.head_offset(layer, block, head);
        &self.keys[at..at + self.layout.head_block()]
    }

    /// The values of one head in one block: `BLOCK_TOKENS` rows of `head_dim`.
    pub fn values(&self, layer: usize, block: usize, head: usize) -> &[E] {
        let at = self.head_offset(layer, block, head);
        &self.values[at..at + self.layout.head_block()]
    }
}

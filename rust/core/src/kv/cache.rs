//! `KvCache`: the bytes of the paged KV cache. Storage is `[layer][block][kv_head]` then, for values,
//! `[slot][dim]` and, for keys, transposed `[dim][slot]`: attention scores a whole block of 16 keys
//! with 16-wide vector multiply-adds (no horizontal sums), and sums values row by row.
//! The cache never decides which block a token goes to: callers pass block ids from a block table.
//! The element type is a parameter ([`KvElem`]: f32, f16 or int8). A scaled type (int8) also keeps,
//! per `[layer][block][kv_head]`, the 16 keys' row scales then the 16 values'.

use super::elem::{inverse_scale, KvElem};
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

    /// Row scales of one block in one layer (all heads; keys then values per head).
    fn layer_scales(&self) -> usize {
        self.n_kv_heads * SCALES_PER_HEAD
    }

    /// Bytes of keys and values (and their row scales, for a scaled type) one block holds over all layers.
    pub fn block_bytes<E: KvElem>(&self) -> usize {
        let scales = if E::SCALED { self.layer_scales() * std::mem::size_of::<f32>() } else { 0 };
        self.n_layers * (2 * self.layer_block() * std::mem::size_of::<E>() + scales)
    }
}

/// Row scales kept per head and block: one per key, then one per value.
const SCALES_PER_HEAD: usize = 2 * BLOCK_TOKENS;

/// The scale of every row of an unscaled type.
static UNIT_SCALES: [f32; BLOCK_TOKENS] = [1.0; BLOCK_TOKENS];

/// Keys and values for `num_blocks` physical blocks of every layer.
pub struct KvCache<E: KvElem> {
    layout: KvLayout,
    num_blocks: usize,
    keys: HugeBuf<E>,
    values: HugeBuf<E>,
    scales: HugeBuf<f32>,
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
                num_blocks.saturating_mul(layout.block_bytes::<E>())
            ))
        };
        let scales = if E::SCALED { layout.n_layers * num_blocks * layout.layer_scales() } else { 0 };
        let keys = HugeBuf::zeroed(len).ok_or_else(fail)?;
        let values = HugeBuf::zeroed(len).ok_or_else(fail)?;
        let scales = HugeBuf::zeroed(scales).ok_or_else(fail)?;
        Ok(KvCache { layout, num_blocks, keys, values, scales })
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

    /// Where the row scales of one head in one block start (a scaled type only).
    fn scale_offset(&self, layer: usize, block: usize, head: usize) -> usize {
        ((layer * self.num_blocks + block) * self.layout.n_kv_heads + head) * SCALES_PER_HEAD
    }

    /// Stores one token's keys and values (all KV heads, `kv_dim` values each) at `slot` of `block`.
    pub fn write(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.layout.head_dim;
        assert!(slot < BLOCK_TOKENS && k.len() == self.layout.n_kv_heads * d && v.len() == k.len());
        for head in 0..self.layout.n_kv_heads {
            let at = self.head_offset(layer, block, head) + slot * d;
            let (k_head, v_head) = (&k[head * d..(head + 1) * d], &v[head * d..(head + 1) * d]);
            let (k_scale, v_scale) = (E::row_scale(k_head), E::row_scale(v_head));
            if E::SCALED {
                let scales = self.scale_offset(layer, block, head);
                self.scales[scales + slot] = k_scale;
                self.scales[scales + BLOCK_TOKENS + slot] = v_scale;
            }
            let inverse = inverse_scale(v_scale);
            for (dst, &x) in self.values[at..at + d].iter_mut().zip(v_head) {
                *dst = E::encode(x, inverse);
            }
            let (key_block, inverse) = (at - slot * d, inverse_scale(k_scale));
            for (i, &x) in k_head.iter().enumerate() {
                self.keys[key_block + i * BLOCK_TOKENS + slot] = E::encode(x, inverse);
            }
        }
    }

    /// Appends the raw bytes of `block` to `out`: each layer's keys, values, then row scales (a scaled
    /// type), in storage layout (`layout.block_bytes::<E>()` bytes). A cache file's block record.
    pub fn read_block(&self, block: usize, out: &mut Vec<u8>) {
        let n = self.layout.layer_block();
        for layer in 0..self.layout.n_layers {
            let at = self.head_offset(layer, block, 0);
            out.extend_from_slice(as_bytes(&self.keys[at..at + n]));
            out.extend_from_slice(as_bytes(&self.values[at..at + n]));
            if E::SCALED {
                let scales = self.scale_offset(layer, block, 0);
                out.extend_from_slice(as_bytes(&self.scales[scales..scales + self.layout.layer_scales()]));
            }
        }
    }

    /// Overwrites `block` with bytes [`read_block`](Self::read_block) gave (of a cache with the same
    /// layout and element type).
    pub fn write_block(&mut self, block: usize, bytes: &[u8]) -> Result<()> {
        let want = self.layout.block_bytes::<E>();
        if bytes.len() != want {
            return Err(Error::Shape(format!("a KV block holds {want} bytes, got {}", bytes.len())));
        }
        let n = self.layout.layer_block();
        let half = n * std::mem::size_of::<E>();
        for (layer, chunk) in bytes.chunks_exact(want / self.layout.n_layers).enumerate() {
            let at = self.head_offset(layer, block, 0);
            as_bytes_mut(&mut self.keys[at..at + n]).copy_from_slice(&chunk[..half]);
            as_bytes_mut(&mut self.values[at..at + n]).copy_from_slice(&chunk[half..2 * half]);
            if E::SCALED {
                let scales = self.scale_offset(layer, block, 0);
                let scales = &mut self.scales[scales..scales + self.layout.layer_scales()];
                as_bytes_mut(scales).copy_from_slice(&chunk[2 * half..]);
            }
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

    /// The row scales of one head's 16 keys in one block (all 1 for an unscaled type).
    pub fn key_scales(&self, layer: usize, block: usize, head: usize) -> &[f32; BLOCK_TOKENS] {
        self.row_scales(layer, block, head, 0)
    }

    /// The row scales of one head's 16 values in one block (all 1 for an unscaled type).
    pub fn value_scales(&self, layer: usize, block: usize, head: usize) -> &[f32; BLOCK_TOKENS] {
        self.row_scales(layer, block, head, BLOCK_TOKENS)
    }

    fn row_scales(&self, layer: usize, block: usize, head: usize, part: usize) -> &[f32; BLOCK_TOKENS] {
        if !E::SCALED {
            return &UNIT_SCALES;
        }
        let at = self.scale_offset(layer, block, head) + part;
        self.scales[at..at + BLOCK_TOKENS].try_into().expect("a block holds 16 row scales")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{F16, I8};

    fn layout() -> KvLayout {
        KvLayout { n_layers: 2, n_kv_heads: 3, head_dim: 32 }
    }

    /// Writes every slot of block 1 with rows whose magnitude differs per token.
    fn filled() -> (KvCache<I8>, Vec<Vec<f32>>) {
        let mut cache = KvCache::<I8>::new(layout(), 3).unwrap();
        let mut rows = Vec::new();
        for layer in 0..2 {
            for slot in 0..BLOCK_TOKENS {
                let k: Vec<f32> =
                    (0..96).map(|i| ((i * 7 + slot * 13 + layer) as f32).sin() * (slot + 1) as f32).collect();
                let v: Vec<f32> = k.iter().map(|x| x * -0.5 + 0.25).collect();
                cache.write(layer, 1, slot, &k, &v);
                rows.push(k);
                rows.push(v);
            }
        }
        (cache, rows)
    }

    #[test]
    fn int8_rows_read_back_within_half_a_step_of_their_own_scale() {
        let (cache, rows) = filled();
        let d = 32;
        for layer in 0..2 {
            for head in 0..3 {
                let (keys, values) = (cache.keys(layer, 1, head), cache.values(layer, 1, head));
                let (k_scales, v_scales) = (cache.key_scales(layer, 1, head), cache.value_scales(layer, 1, head));
                for slot in 0..BLOCK_TOKENS {
                    let (k, v) =
                        (&rows[(layer * BLOCK_TOKENS + slot) * 2], &rows[(layer * BLOCK_TOKENS + slot) * 2 + 1]);
                    for i in 0..d {
                        let key = keys[i * BLOCK_TOKENS + slot].to_f32() * k_scales[slot];
                        let value = values[slot * d + i].to_f32() * v_scales[slot];
                        assert!(
                            (key - k[head * d + i]).abs() <= k_scales[slot] * 0.501,
                            "key {layer} {head} {slot} {i}"
                        );
                        assert!(
                            (value - v[head * d + i]).abs() <= v_scales[slot] * 0.501,
                            "value {layer} {head} {slot} {i}"
                        );
                    }
                }
            }
        }
        assert_eq!(cache.key_scales(0, 0, 0), &[0.0; BLOCK_TOKENS], "an unwritten block has zero scales");
    }

    #[test]
    fn a_block_read_out_writes_back_with_its_scales() {
        let (cache, _) = filled();
        let mut bytes = Vec::new();
        cache.read_block(1, &mut bytes);
        assert_eq!(bytes.len(), layout().block_bytes::<I8>());
        assert_eq!(bytes.len(), 2 * (2 * 3 * BLOCK_TOKENS * 32 + 3 * 2 * BLOCK_TOKENS * 4));
        let mut copy = KvCache::<I8>::new(layout(), 3).unwrap();
        copy.write_block(2, &bytes).unwrap();
        for (layer, head) in [(0, 0), (1, 2)] {
            assert_eq!(copy.keys(layer, 2, head), cache.keys(layer, 1, head));
            assert_eq!(copy.values(layer, 2, head), cache.values(layer, 1, head));
            assert_eq!(copy.key_scales(layer, 2, head), cache.key_scales(layer, 1, head));
            assert_eq!(copy.value_scales(layer, 2, head), cache.value_scales(layer, 1, head));
        }
        assert!(copy.write_block(0, &bytes[1..]).is_err());
        assert_eq!(KvCache::<F16>::new(layout(), 1).unwrap().key_scales(1, 0, 2), &[1.0; BLOCK_TOKENS]);
    }
}

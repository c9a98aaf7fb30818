//! The repacked weight layout of the LUT kernels.
//!
//! Rows are grouped in tiles of 32 (the last tile padded with zero-scale rows). For tile `t` and
//! 128-block `b` there are 512 bytes of sign bits, a transpose of the GGUF layout: byte `32 * c + r`
//! is byte `qs[c]` of row `32t + r`. Its low nibble holds the 4 signs of weight group `2c` and its
//! high nibble those of group `2c + 1`, so a 32-byte load gives 32 rows x 2 groups of table indices.
//! The 32 fp16 scales of the tile-block stay fp16 (same bytes per weight as GGUF).

use super::super::block::{BlockQ1, BLOCK_WEIGHTS};
use crate::huge::HugeBuf;

/// Rows per tile.
pub const TILE_ROWS: usize = 32;
/// Sign-bit bytes per tile and 128-block.
pub const TILE_BLOCK_BYTES: usize = TILE_ROWS * 16;

/// Q1_0 weights repacked for the LUT kernels.
#[derive(Clone, Debug)]
pub struct LutPacked {
    pub rows: usize,
    pub cols: usize,
    /// Number of 32-row tiles.
    pub tiles: usize,
    /// 128-blocks per row.
    pub kb: usize,
    /// `tiles * kb * 512` bytes of sign bits (see the module doc).
    pub bits: HugeBuf<u8>,
    /// `tiles * kb * 32` fp16 scales as raw bits, row `r` of tile-block `(t, b)` at `(t*kb + b)*32 + r`.
    pub scales: HugeBuf<u16>,
}

impl LutPacked {
    /// Repacks `rows x cols` GGUF-layout blocks.
    pub fn pack(blocks: &[BlockQ1], rows: usize, cols: usize) -> LutPacked {
        let kb = cols / BLOCK_WEIGHTS;
        assert_eq!(blocks.len(), rows * kb);
        let tiles = rows.div_ceil(TILE_ROWS);
        // A large matrix (2 MiB of bits or more) gets huge pages where the kernel grants them.
        let mut bits = HugeBuf::zeroed(tiles * kb * TILE_BLOCK_BYTES).expect("out of memory repacking weights");
        let mut scales = HugeBuf::zeroed(tiles * kb * TILE_ROWS).expect("out of memory repacking weights");
        for row in 0..rows {
            let (t, r) = (row / TILE_ROWS, row % TILE_ROWS);
            for b in 0..kb {
                let block = &blocks[row * kb + b];
                let tb = t * kb + b;
                for (c, &byte) in block.qs.iter().enumerate() {
                    bits[tb * TILE_BLOCK_BYTES + 32 * c + r] = byte;
                }
                scales[tb * TILE_ROWS + r] = u16::from_le_bytes(block.d);
            }
        }
        LutPacked { rows, cols, tiles, kb, bits, scales }
    }

    /// The 512 sign-bit bytes of tile `t`, block `b`.
    #[inline]
    pub fn tile_block_bits(&self, t: usize, b: usize) -> &[u8] {
        let at = (t * self.kb + b) * TILE_BLOCK_BYTES;
        &self.bits[at..at + TILE_BLOCK_BYTES]
    }

    /// The 32 fp16 scales of tile `t`, block `b`.
    #[inline]
    pub fn tile_block_scales(&self, t: usize, b: usize) -> &[u16] {
        let at = (t * self.kb + b) * TILE_ROWS;
        &self.scales[at..at + TILE_ROWS]
    }

    /// Bytes held by the repacked copy.
    pub fn nbytes(&self) -> usize {
        self.bits.len() + 2 * self.scales.len()
    }
}

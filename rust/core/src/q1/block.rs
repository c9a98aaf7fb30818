//! The Q1_0 block, byte-compatible with GGUF / ggml type 41.
//!
//! A block holds 128 weights in 18 bytes: `d` (IEEE fp16, little-endian), then 16 bytes of sign bits.
//! Weight `j` is bit `j % 8` of byte `qs[j / 8]`; a set bit means `+d`, a clear bit `-d`.

use half::f16;

/// Weights per block.
pub const BLOCK_WEIGHTS: usize = 128;
/// Bytes per block: 2 for the fp16 scale, 16 for the sign bits.
pub const BLOCK_BYTES: usize = 18;
/// GGML type id of Q1_0.
pub const GGML_TYPE_Q1_0: u32 = 41;

/// One Q1_0 block. Alignment 1, so any byte slice of the right length can be viewed as blocks.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BlockQ1 {
    /// fp16 scale, little-endian bytes.
    pub d: [u8; 2],
    /// Sign bits, least significant bit first.
    pub qs: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<BlockQ1>() == BLOCK_BYTES);
const _: () = assert!(std::mem::align_of::<BlockQ1>() == 1);

impl BlockQ1 {
    /// The scale as f32.
    #[inline]
    pub fn scale(&self) -> f32 {
        f16::from_le_bytes(self.d).to_f32()
    }

    /// The sign of weight `j`: `true` for `+d`.
    #[inline]
    pub fn is_positive(&self, j: usize) -> bool {
        (self.qs[j / 8] >> (j % 8)) & 1 == 1
    }
}

/// Views a byte slice whose length is a multiple of [`BLOCK_BYTES`] as blocks, without copying.
pub fn as_blocks(bytes: &[u8]) -> &[BlockQ1] {
    assert_eq!(bytes.len() % BLOCK_BYTES, 0, "byte length must be a multiple of 18");
    // SAFETY: BlockQ1 is repr(C), 18 bytes, alignment 1, and every bit pattern is valid, so any
    // 18*n bytes are n valid blocks; the lifetime is tied to `bytes`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<BlockQ1>(), bytes.len() / BLOCK_BYTES) }
}

/// Views blocks as their bytes, without copying.
pub fn blocks_as_bytes(blocks: &[BlockQ1]) -> &[u8] {
    // SAFETY: BlockQ1 is plain bytes (repr(C), no padding, alignment 1).
    unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), blocks.len() * BLOCK_BYTES) }
}

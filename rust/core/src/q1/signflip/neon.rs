//! NEON sign-flip block sum: sign bits to byte masks (`vqtbl1q_u8` spreads each bit's byte over
//! eight lanes, `vtstq_u8` tests one bit per lane), then the activations where the weight is `+d`
//! and where it is `-d` are widened pairwise to int16 and subtracted. Widening before the negation
//! keeps the sum exact for every int8 input, -128 included, like the scalar kernel.

use std::arch::aarch64::*;

use super::super::block::BlockQ1;

/// Byte `j % 8` of lane `j`: the bit that lane tests within its byte.
const LANE_BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
/// Which of the chunk's two sign bytes lane `j` reads (before adding `2 * chunk`).
const LANE_BYTES: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];

/// `sum_j (bit j set ? q[j] : -q[j])` over one block.
///
/// # Safety
/// The CPU must support NEON (always true on aarch64 Linux).
#[target_feature(enable = "neon")]
pub unsafe fn block_sum(block: &BlockQ1, q: &[i8]) -> i32 {
    assert!(q.len() >= 128);
    let signs = vld1q_u8(block.qs.as_ptr());
    let lane_bits = vld1q_u8(LANE_BITS.as_ptr());
    let mut which = vld1q_u8(LANE_BYTES.as_ptr());
    // Per int16 lane: 8 chunks x 2 values x 128 at most = 2048, far from overflow.
    let mut acc = vdupq_n_s16(0);
    for c in 0..8 {
        let plus = vtstq_u8(vqtbl1q_u8(signs, which), lane_bits);
        let x = vld1q_s8(q.as_ptr().add(16 * c));
        let pos = vandq_s8(x, vreinterpretq_s8_u8(plus));
        let neg = vbicq_s8(x, vreinterpretq_s8_u8(plus));
        acc = vaddq_s16(acc, vsubq_s16(vpaddlq_s8(pos), vpaddlq_s8(neg)));
        which = vaddq_u8(which, vdupq_n_u8(2));
    }
    vaddlvq_s16(acc)
}

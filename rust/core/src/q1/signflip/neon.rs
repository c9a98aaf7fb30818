//! NEON sign-flip block sum: each sign byte is spread over eight int16 lanes and `vtstq_u16` tests
//! one bit per lane; the activations are negated where the bit is clear (`vbslq_s16`) and added in
//! int16. Each lane adds a subset of the block's signed values, so it never exceeds the block's L1
//! norm: no overflow, like the scalar kernel.

use std::arch::aarch64::*;

use super::super::block::BlockQ1;

/// The bit lane `j` tests within its sign byte.
const LANE_BITS: [u16; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// `sum_j (bit j set ? q[j] : -q[j])` over one block.
///
/// # Safety
/// The CPU must support NEON (always true on aarch64 Linux).
#[target_feature(enable = "neon")]
pub unsafe fn block_sum(block: &BlockQ1, q: &[i16]) -> i32 {
    assert!(q.len() >= 128);
    let lane_bits = vld1q_u16(LANE_BITS.as_ptr());
    let mut acc = vdupq_n_s16(0);
    for (c, &byte) in block.qs.iter().enumerate() {
        let plus = vtstq_u16(vdupq_n_u16(u16::from(byte)), lane_bits);
        let x = vld1q_s16(q.as_ptr().add(8 * c));
        acc = vaddq_s16(acc, vbslq_s16(plus, x, vnegq_s16(x)));
    }
    vaddlvq_s16(acc)
}

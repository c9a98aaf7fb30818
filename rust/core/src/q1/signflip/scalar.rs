//! Portable sign-flip block sum.

use super::super::block::BlockQ1;

/// `sum_j (bit j set ? q[j] : -q[j])` over one block.
pub fn block_sum(block: &BlockQ1, q: &[i16]) -> i32 {
    q[..128].iter().enumerate().map(|(j, &v)| if block.is_positive(j) { i32::from(v) } else { -i32::from(v) }).sum()
}

//! The sign-flip kernel (llama.cpp's strategy), over the unrepacked GGUF layout: the in-house
//! baseline the LUT kernels are measured against. For each row and 128-block, the int16 activations
//! are negated where the weight's sign bit is clear and summed exactly (every partial sum is at most
//! the block's L1 norm, within int16); the block sum is scaled as `acc = fma(isum, d_w * d_a, acc)`,
//! the same as every other kernel.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;

use super::act::QuantizedActs;
use super::block::BlockQ1;
use super::par::SharedOut;
use super::Isa;
use crate::pool::Pool;

/// Rows handled by one pool task at least.
const MIN_ROWS_PER_TASK: usize = 16;

/// `out[i, r] = sum_k w[r, k] * x[i, k]` row by row over GGUF-layout blocks.
pub fn gemv(blocks: &[BlockQ1], rows: usize, acts: &QuantizedActs, out: &mut [f32], isa: Isa, pool: &Pool) {
    let kb = acts.blocks_per_row();
    assert_eq!(blocks.len(), rows * kb);
    for i in 0..acts.n {
        let (q, scales) = (acts.row(i), &acts.scale[i * kb..(i + 1) * kb]);
        let shared = SharedOut::new(&mut out[i * rows..(i + 1) * rows]);
        pool.for_each_range(rows, MIN_ROWS_PER_TASK, |range| {
            let sums: Vec<f32> =
                range.clone().map(|r| row_dot(&blocks[r * kb..(r + 1) * kb], q, scales, isa)).collect();
            // SAFETY: each task owns its range of rows.
            unsafe { shared.write(range.start, &sums) };
        });
    }
}

fn row_dot(row: &[BlockQ1], q: &[i16], scales: &[f32], isa: Isa) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2, FMA and F16C are present (checked by `has_avx2`).
        return unsafe { avx2::row_dot(row, q, scales) };
    }
    let mut acc = 0f32;
    for ((block, qb), &da) in row.iter().zip(q.chunks_exact(128)).zip(scales) {
        acc = (block_sum(block, qb, isa) as f32).mul_add(block.scale() * da, acc);
    }
    acc
}

#[inline]
fn block_sum(block: &BlockQ1, q: &[i16], isa: Isa) -> i32 {
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        // SAFETY: NEON is present (checked by `has_neon`).
        return unsafe { neon::block_sum(block, q) };
    }
    let _ = isa;
    scalar::block_sum(block, q)
}

//! `Linear`: one weight matrix of the model, Q1_0 (the Bonsai case, through the Q1 kernels) or dense
//! f32 (F32/F16/BF16 tensors, widened once at load). Also the embedding lookup over the same storage.

use crate::error::Result;
use crate::pool::Pool;
use crate::q1::{Isa, Kernel, Q1Matrix};

use super::ops::dot;

/// How matmuls run: the Q1 kernel family and instruction set.
#[derive(Clone, Copy, Debug)]
pub struct MatmulPlan {
    pub kernel: Kernel,
    pub isa: Isa,
}

/// A `rows x cols` weight matrix (`rows` outputs, `cols` inputs).
pub enum Linear {
    Q1(Q1Matrix),
    Dense { rows: usize, cols: usize, w: Vec<f32> },
}

impl Linear {
    pub fn rows(&self) -> usize {
        match self {
            Linear::Q1(m) => m.rows(),
            Linear::Dense { rows, .. } => *rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Linear::Q1(m) => m.cols(),
            Linear::Dense { cols, .. } => *cols,
        }
    }

    /// `out[i, r] = sum_k w[r, k] * x[i, k]` for `n` rows of `x`.
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32], plan: MatmulPlan, pool: &Pool) -> Result<()> {
        match self {
            Linear::Q1(m) => m.matmul(x, n, out, plan.kernel, plan.isa, pool),
            Linear::Dense { rows, cols, w } => {
                pool.for_each_row_mut(out, *rows, 1, |i, out_row| {
                    let xi = &x[i * cols..(i + 1) * cols];
                    for (r, o) in out_row.iter_mut().enumerate() {
                        *o = dot(&w[r * cols..(r + 1) * cols], xi);
                    }
                });
                Ok(())
            }
        }
    }

    /// [`Linear::forward`] of several matrices over the same `x`, each into its own output; Q1
    /// matrices share one activation quantization and, for a single row, one GEMV job
    /// ([`Q1Matrix::matmul_shared`]). The outputs are those of separate `forward` calls.
    pub fn forward_shared(
        ls: &[&Linear],
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
        plan: MatmulPlan,
        pool: &Pool,
    ) -> Result<()> {
        let q1: Option<Vec<&Q1Matrix>> =
            ls.iter().map(|l| if let Linear::Q1(m) = l { Some(m) } else { None }).collect();
        match q1 {
            Some(mats) => Q1Matrix::matmul_shared(&mats, x, n, outs, plan.kernel, plan.isa, pool),
            None => ls.iter().zip(outs.iter_mut()).try_for_each(|(l, out)| l.forward(x, n, out, plan, pool)),
        }
    }

    /// Row `r` as f32 (the embedding lookup), without touching any other row.
    pub fn row(&self, r: usize, out: &mut [f32]) {
        match self {
            Linear::Q1(m) => m.dequantize_row(r, out),
            Linear::Dense { cols, w, .. } => out.copy_from_slice(&w[r * cols..(r + 1) * cols]),
        }
    }
}

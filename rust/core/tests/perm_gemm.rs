//! The 6-bit lookup small GEMM (`Kernel::PermGemm`, `lut::perm`) against the scalar LUT GEMM, bit for
//! bit, on random shapes across tile groups, passes, column chunks and thread counts. (On CPUs without
//! AVX-512 the kernel name falls back to the LUT GEMM, so these still run; `kernels.rs` checks every
//! kernel at the int16 bound.)

mod common;

use common::{matmul as run, Rng};
use oxibonsai_core::pool::Pool;
use oxibonsai_core::q1::{Isa, Kernel, Q1Matrix};

#[test]
fn perm_gemm_equals_the_scalar_lut_gemm_on_random_shapes() {
    let mut rng = Rng::fresh("perm shapes");
    for threads in [1, 3] {
        let pool = Pool::new(threads);
        for rows in [1, 33, 95, 4097] {
            for cols in [128, 256, 4224] {
                let m = Q1Matrix::quantize(&rng.weights(rows * cols), rows, cols).unwrap();
                for n in [2, 3, 16, 17, 64, 65] {
                    let x = rng.activations(n * cols);
                    let want = run(&m, &x, n, Kernel::LutGemm, Isa::Scalar, &pool);
                    for isa in Isa::available() {
                        let got = run(&m, &x, n, Kernel::PermGemm, isa, &pool);
                        assert_eq!(got, want, "{isa} ({rows}, {cols}) n={n} threads={threads}");
                    }
                }
            }
        }
    }
}

//! The 6-bit lookup small GEMM (`Kernel::PermGemm`, `lut::perm`) against the scalar LUT GEMM, bit for
//! bit, on random shapes across tile groups, passes, column chunks and thread counts, and at the int16
//! bound. (On CPUs without AVX-512 the kernel name falls back to the LUT GEMM, so these still run.)

mod common;

use common::{matmul as run, Rng};
use oxibonsai_core::pool::Pool;
use oxibonsai_core::q1::act::quantize_acts;
use oxibonsai_core::q1::reference::exact_int8;
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

/// Activation rows of equal magnitude and mixed signs quantize to +-127 exactly; rows of weights with
/// the same (or the opposite) signs then give block sums of +-128 * 127, the int16 accumulator's bound.
#[test]
fn perm_gemm_is_exact_at_the_int16_bound() {
    let mut rng = Rng::fresh("perm extremes");
    let (rows, cols, n) = (70, 512, 5);
    let x: Vec<f32> = (0..n * cols).map(|_| if rng.next_u64() & 1 == 1 { 3.0 } else { -3.0 }).collect();
    let mut w = rng.weights(rows * cols);
    for k in 0..cols {
        let s = x[k].signum();
        w[k] = s * w[k].abs();
        w[cols + k] = -s * w[cols + k].abs();
    }
    let m = Q1Matrix::quantize(&w, rows, cols).unwrap();
    let acts = quantize_acts(&x, n, cols, Isa::Scalar).unwrap();
    assert!(acts.q.iter().all(|q| q.abs() == 127));
    let exact = exact_int8(m.blocks(), rows, &acts);
    for threads in [1, 3] {
        let pool = Pool::new(threads);
        let want = run(&m, &x, n, Kernel::LutGemm, Isa::Scalar, &pool);
        for isa in Isa::available() {
            let got = run(&m, &x, n, Kernel::PermGemm, isa, &pool);
            assert_eq!(got, want, "{isa} threads={threads}");
            assert!(got.iter().all(|v| v.is_finite()));
            // The two extreme rows, whose block sums are +-16256, to float rounding.
            for (i, r) in (0..n).flat_map(|i| [(i, 0), (i, 1)]) {
                let (g, e) = (f64::from(got[i * rows + r]), exact[i * rows + r]);
                assert!((g - e).abs() <= 1e-5 * e.abs(), "{isa} row {r}: {g} vs {e}");
            }
        }
    }
}

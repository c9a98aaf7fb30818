//! Every kernel family on every instruction set this CPU has, against the exact f64 value of the
//! quantized computation, against each other (bit for bit), and across thread counts.

mod common;

use common::{matmul as run, Rng};
use oxibonsai_core::pool::Pool;
use oxibonsai_core::q1::act::{quantize_acts, L1_MAX};
use oxibonsai_core::q1::lut::{build_tables, gemm_name};
use oxibonsai_core::q1::reference::exact_quantized;
use oxibonsai_core::q1::{Isa, Kernel, Q1Matrix};

const QUANTIZED_KERNELS: [Kernel; 8] = [
    Kernel::Lut,
    Kernel::Gemm,
    Kernel::LutGemm,
    Kernel::VnniGemm,
    Kernel::PermGemm,
    Kernel::AmxGemm,
    Kernel::SignFlip,
    Kernel::Auto,
];

fn rel_err(y: &[f32], exact: &[f64]) -> f64 {
    let num: f64 = y.iter().zip(exact).map(|(&a, &b)| (f64::from(a) - b).powi(2)).sum();
    let den: f64 = exact.iter().map(|b| b * b).sum();
    (num / den.max(1e-300)).sqrt()
}

#[test]
fn quantized_kernels_match_exact_reference_and_each_other_on_odd_shapes() {
    let mut rng = Rng::fresh("odd shapes");
    let pool = Pool::new(2);
    for (rows, cols) in [(1, 128), (33, 128), (33, 1152), (70, 4224), (257, 256)] {
        let m = Q1Matrix::quantize(&rng.weights(rows * cols), rows, cols).unwrap();
        for n in [1, 3, 17, 64, 65] {
            let x = rng.activations(n * cols);
            let acts = quantize_acts(&x, n, cols, Isa::Scalar).unwrap();
            let exact = exact_quantized(m.blocks(), rows, &acts);
            let first = run(&m, &x, n, Kernel::Lut, Isa::Scalar, &pool);
            for isa in Isa::available() {
                for kernel in QUANTIZED_KERNELS {
                    let y = run(&m, &x, n, kernel, isa, &pool);
                    assert!(rel_err(&y, &exact) < 1e-5, "{isa} {kernel:?} ({rows}, {cols}) n={n}");
                    assert_eq!(y, first, "{isa} {kernel:?} ({rows}, {cols}) n={n} differs from scalar LUT");
                }
            }
        }
    }
}

/// The small GEMMs (6-bit lookup on AVX-512, VNNI where the CPU has it) against the exact value and,
/// bit for bit, the scalar and AVX2 LUT GEMMs, for random shapes: rows rarely a multiple of 32, 2..=70
/// activation rows (across the 64-row chunks and the 16-row passes).
#[test]
fn gemm_matches_lut_gemms_bit_for_bit_on_random_shapes() {
    let mut rng = Rng::fresh("gemm shapes");
    let pool = Pool::new(2);
    let isas = Isa::available();
    for _ in 0..12 {
        let rows = 1 + (rng.next_u64() % 150) as usize;
        let cols = 128 * (1 + (rng.next_u64() % 6) as usize);
        let n = 2 + (rng.next_u64() % 69) as usize;
        let m = Q1Matrix::quantize(&rng.weights(rows * cols), rows, cols).unwrap();
        let x = rng.activations(n * cols);
        let exact = exact_quantized(m.blocks(), rows, &quantize_acts(&x, n, cols, Isa::Scalar).unwrap());
        let want = run(&m, &x, n, Kernel::LutGemm, Isa::Scalar, &pool);
        assert!(rel_err(&want, &exact) < 1e-5, "scalar ({rows}, {cols}) n={n}");
        for &isa in &isas {
            for kernel in
                [Kernel::Gemm, Kernel::LutGemm, Kernel::VnniGemm, Kernel::PermGemm, Kernel::AmxGemm, Kernel::Auto]
            {
                let y = run(&m, &x, n, kernel, isa, &pool);
                assert_eq!(y, want, "{isa} {kernel:?} ({rows}, {cols}) n={n} differs from the scalar LUT GEMM");
            }
        }
    }
}

/// `matmul_shared` (one quantization, one GEMV job over every matrix) gives each matrix exactly what
/// `matmul` gives it alone, for random row counts (tile ranges of a task then straddle matrices),
/// every kernel, ISA and 1 or several activation rows.
#[test]
fn shared_matmul_equals_separate_matmuls_bit_for_bit() {
    let mut rng = Rng::fresh("shared matmul");
    for threads in [1, 3] {
        let pool = Pool::new(threads);
        for _ in 0..6 {
            let cols = 128 * (1 + (rng.next_u64() % 4) as usize);
            let count = 1 + (rng.next_u64() % 3) as usize;
            let rows: Vec<usize> = (0..count).map(|_| 1 + (rng.next_u64() % 200) as usize).collect();
            let mats: Vec<Q1Matrix> =
                rows.iter().map(|&r| Q1Matrix::quantize(&rng.weights(r * cols), r, cols).unwrap()).collect();
            let refs: Vec<&Q1Matrix> = mats.iter().collect();
            for n in [1, 2, 5] {
                let x = rng.activations(n * cols);
                for isa in Isa::available() {
                    for kernel in QUANTIZED_KERNELS.into_iter().chain([Kernel::Reference]) {
                        let mut outs: Vec<Vec<f32>> = rows.iter().map(|r| vec![f32::NAN; n * r]).collect();
                        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                        Q1Matrix::matmul_shared(&refs, &x, n, &mut views, kernel, isa, &pool).unwrap();
                        for (m, got) in mats.iter().zip(&outs) {
                            let want = run(m, &x, n, kernel, isa, &pool);
                            assert_eq!(got, &want, "{isa} {kernel:?} rows {rows:?} cols {cols} n={n}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn shared_matmul_rejects_mismatched_shapes() {
    let mut rng = Rng::fresh("shared shapes");
    let pool = Pool::new(1);
    let (a, b) = (
        Q1Matrix::quantize(&rng.weights(4 * 128), 4, 128).unwrap(),
        Q1Matrix::quantize(&rng.weights(4 * 256), 4, 256).unwrap(),
    );
    let x = rng.activations(128);
    let (mut o1, mut o2) = (vec![0.0; 4], vec![0.0; 4]);
    assert!(
        Q1Matrix::matmul_shared(&[&a, &b], &x, 1, &mut [&mut o1, &mut o2], Kernel::Auto, Isa::Scalar, &pool).is_err()
    );
    assert!(Q1Matrix::matmul_shared(&[&a, &a], &x, 1, &mut [&mut o1], Kernel::Auto, Isa::Scalar, &pool).is_err());
    let mut short = vec![0.0; 3];
    assert!(Q1Matrix::matmul_shared(&[&a, &a], &x, 1, &mut [&mut o1, &mut short], Kernel::Auto, Isa::Scalar, &pool)
        .is_err());
}

#[test]
fn gemm_name_reports_the_perm_kernel_where_it_runs() {
    for isa in Isa::available() {
        let name = gemm_name(isa);
        assert_eq!(name.starts_with("perm-gemm-"), isa.has_avx512(), "{isa}: {name}");
    }
    if Isa::detect() == Isa::Avx512 {
        assert_eq!(gemm_name(Isa::detect()), "perm-gemm-avx512");
    }
}

#[test]
fn reference_kernel_matches_dequantized_f64_product() {
    let mut rng = Rng::fresh("reference");
    let (rows, cols, n) = (45, 384, 3);
    let m = Q1Matrix::quantize(&rng.weights(rows * cols), rows, cols).unwrap();
    let mut w = vec![0f32; rows * cols];
    m.dequantize_into(&mut w).unwrap();
    let x = rng.activations(n * cols);
    let y = run(&m, &x, n, Kernel::Reference, Isa::Scalar, &Pool::new(1));
    for i in 0..n {
        for r in 0..rows {
            let exact: f64 = (0..cols).map(|k| f64::from(w[r * cols + k]) * f64::from(x[i * cols + k])).sum();
            let scale: f64 = (0..cols).map(|k| (f64::from(w[r * cols + k]) * f64::from(x[i * cols + k])).abs()).sum();
            assert!((f64::from(y[i * rows + r]) - exact).abs() <= 1e-5 * scale, "row {r}");
        }
    }
}

#[test]
fn results_are_bit_identical_for_any_thread_count() {
    let mut rng = Rng::fresh("threads");
    let (rows, cols, n) = (1000, 1024, 5);
    let m = Q1Matrix::quantize(&rng.weights(rows * cols), rows, cols).unwrap();
    let x = rng.activations(n * cols);
    for kernel in QUANTIZED_KERNELS.into_iter().chain([Kernel::Reference]) {
        let one = run(&m, &x, n, kernel, Isa::detect(), &Pool::new(1));
        for threads in [2, 3, 4] {
            assert_eq!(one, run(&m, &x, n, kernel, Isa::detect(), &Pool::new(threads)), "{kernel:?} x{threads}");
        }
    }
}

#[test]
fn activation_quantization_and_tables_are_identical_on_every_isa() {
    let mut rng = Rng::fresh("acts");
    let (n, k) = (4, 1024);
    let mut x = rng.activations(n * k);
    x[..128].fill(0.0);
    let scalar = quantize_acts(&x, n, k, Isa::Scalar).unwrap();
    let l1 = |b: &[i16]| b.iter().map(|&q| i32::from(q).abs()).sum::<i32>();
    assert!(scalar.q.chunks_exact(128).all(|b| l1(b) <= L1_MAX));
    assert_eq!(scalar.scale[0], 0.0);
    let mut want = vec![0u8; k / 4 * 32];
    build_tables(scalar.row(1), &mut want, Isa::Scalar);
    for isa in Isa::available() {
        let acts = quantize_acts(&x, n, k, isa).unwrap();
        assert_eq!(acts, scalar, "{isa}");
        let mut got = vec![0u8; k / 4 * 32];
        build_tables(acts.row(1), &mut got, isa);
        assert_eq!(got, want, "{isa}");
    }
}

/// Blocks whose integer sums reach the int16 bound: activations of equal magnitude and mixed signs
/// (every |q| = 254), or with one massive value per block (|q| up to ~32000, both byte planes
/// near their ends); weight rows 0 and 1 take the signs of the activations of row 0 (or their
/// opposites), so their block sums are +-(sum |q|), close to `L1_MAX`. Every kernel and ISA gives
/// the same bits, within float rounding of the exact value.
#[test]
fn every_kernel_is_exact_at_the_int16_bound() {
    let mut rng = Rng::fresh("int16 bound");
    let (rows, cols, n) = (70, 512, 5);
    for massive in [0.0f32, 3000.0] {
        let mut x: Vec<f32> = (0..n * cols).map(|_| if rng.next_u64() & 1 == 1 { 3.0 } else { -3.0 }).collect();
        for (i, v) in x.iter_mut().enumerate() {
            if i % 128 == (i / 128 * 37) % 128 {
                *v *= massive.max(1.0);
            }
        }
        let mut w = rng.weights(rows * cols);
        for k in 0..cols {
            let s = x[k].signum();
            w[k] = s * w[k].abs();
            w[cols + k] = -s * w[cols + k].abs();
        }
        let m = Q1Matrix::quantize(&w, rows, cols).unwrap();
        let acts = quantize_acts(&x, n, cols, Isa::Scalar).unwrap();
        let l1 = |b: &[i16]| b.iter().map(|&q| i32::from(q).abs()).sum::<i32>();
        assert!(acts.q.chunks_exact(128).all(|b| l1(b) <= L1_MAX && l1(b) > L1_MAX - 200), "massive {massive}");
        let exact = exact_quantized(m.blocks(), rows, &acts);
        for threads in [1, 3] {
            let pool = Pool::new(threads);
            let want = run(&m, &x, n, Kernel::LutGemm, Isa::Scalar, &pool);
            for r in [0, 1] {
                let (g, e) = (f64::from(want[r]), exact[r]);
                assert!((g - e).abs() <= 1e-5 * e.abs(), "massive {massive} row {r}: {g} vs {e}");
            }
            assert!(rel_err(&want, &exact) < 1e-5, "massive {massive}");
            for isa in Isa::available() {
                for kernel in QUANTIZED_KERNELS {
                    let got = run(&m, &x, n, kernel, isa, &pool);
                    assert_eq!(got, want, "{isa} {kernel:?} massive {massive} threads={threads}");
                }
            }
        }
    }
}

#[test]
fn non_finite_activations_are_rejected_by_every_kernel() {
    let m = Q1Matrix::quantize(&vec![0.5; 4 * 256], 4, 256).unwrap();
    for isa in Isa::available() {
        for kernel in QUANTIZED_KERNELS.into_iter().chain([Kernel::Reference]) {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut x = vec![1.0; 2 * 256];
                x[256 + 200] = bad;
                let mut out = vec![0.0; 8];
                let err = m.matmul(&x, 2, &mut out, kernel, isa, &Pool::new(1)).unwrap_err();
                assert!(err.to_string().contains("(1, 200)"), "{isa} {kernel:?}: {err}");
            }
        }
    }
}

//! NEON kernels against the scalar ones (bit for bit) and the exact f64 quantized value, on odd shapes.
//!
//! Runs under qemu-user on x86-64 hosts (`../shared/tools/arm64-test -p oxibonsai-core --test
//! neon_kernels`), where spawned threads hang: so this is a `harness = false` target whose `main`
//! runs every check on the main thread, with 1-thread pools (which never spawn), and panics at the
//! end if any check failed. On other architectures it has nothing to check.

#[cfg(target_arch = "aarch64")]
mod common;

#[cfg(target_arch = "aarch64")]
fn main() {
    let mut checks = aarch64::Checks::default();
    aarch64::run(&mut checks);
    println!("{} passed, {} failed", checks.passed, checks.failed.len());
    assert!(checks.failed.is_empty(), "NEON kernel mismatches:\n{}", checks.failed.join("\n"));
}

#[cfg(not(target_arch = "aarch64"))]
fn main() {
    println!("0 passed, 0 failed (not aarch64)");
}

#[cfg(target_arch = "aarch64")]
mod aarch64 {
    use super::common::Rng;
    use oxibonsai_core::pool::Pool;
    use oxibonsai_core::q1::act::quantize_acts;
    use oxibonsai_core::q1::lut::{build_tables, gemm_name, gemv_name, TABLE_BYTES};
    use oxibonsai_core::q1::reference::exact_quantized;
    use oxibonsai_core::q1::{Isa, Kernel, Q1Matrix, BLOCK_BYTES};

    const QUANTIZED_KERNELS: [Kernel; 5] = [Kernel::Lut, Kernel::Gemm, Kernel::LutGemm, Kernel::SignFlip, Kernel::Auto];

    #[derive(Default)]
    pub struct Checks {
        pub passed: usize,
        pub failed: Vec<String>,
    }

    impl Checks {
        fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
            if ok {
                self.passed += 1;
            } else {
                let what = what();
                println!("FAILED: {what}");
                self.failed.push(what);
            }
        }
    }

    pub fn run(checks: &mut Checks) {
        checks.check(Isa::available().contains(&Isa::Neon), || "NEON is not detected".into());
        checks.check(gemv_name(Isa::Neon) == "lut-neon", || format!("gemv_name: {}", gemv_name(Isa::Neon)));
        checks.check(gemm_name(Isa::Neon) == "lut-gemm-neon", || format!("gemm_name: {}", gemm_name(Isa::Neon)));
        check_activation_edge_cases(checks);
        let mut rng = Rng::fresh("neon kernels");
        for rows in [1, 33, 70] {
            for cols in [128, 384, 1152] {
                let quantized = Q1Matrix::quantize(&rng.weights(rows * cols), rows, cols).unwrap();
                let blocks = rows * cols / 128;
                let raw = Q1Matrix::from_bytes(random_blocks(&mut rng, blocks, 0xffff), rows, cols).unwrap();
                let tiny = Q1Matrix::from_bytes(random_blocks(&mut rng, blocks, 0x83ff), rows, cols).unwrap();
                for (name, m) in [("quantized", &quantized), ("any fp16", &raw), ("subnormal fp16", &tiny)] {
                    for n in [1, 3, 5] {
                        let x = rng.activations(n * cols);
                        check_case(checks, m, &x, n, &format!("{name} ({rows}, {cols}) n={n}"));
                    }
                }
            }
        }
    }

    /// Mixed magnitudes, a zero block, negative zeros, a massive value, huge values and non-finite
    /// input.
    fn check_activation_edge_cases(checks: &mut Checks) {
        let k = 512;
        let mut x: Vec<f32> = (0..k).map(|i| (i % 255) as f32 - 127.0 + if i % 3 == 0 { 0.5 } else { 0.0 }).collect();
        x[0] = 127.0;
        x[128..256].fill(0.0);
        x[256..384].iter_mut().step_by(2).for_each(|v| *v = -0.0);
        x[257] = 3000.0; // a massive value: its block's other values keep few bits
        x[384..].iter_mut().enumerate().for_each(|(i, v)| *v = if i % 5 < 2 { -1e30 } else { 1e30 });
        let scalar = quantize_acts(&x, 1, k, Isa::Scalar).unwrap();
        let neon = quantize_acts(&x, 1, k, Isa::Neon).unwrap();
        checks.check(neon == scalar, || format!("edge activations: {:?} != {:?}", &neon.q[..16], &scalar.q[..16]));
        let mut want = vec![0u8; k / 4 * TABLE_BYTES];
        let mut got = want.clone();
        build_tables(scalar.row(0), &mut want, Isa::Scalar);
        build_tables(scalar.row(0), &mut got, Isa::Neon);
        checks.check(got == want, || "edge activations: build_tables differs".into());
        let m = Q1Matrix::quantize(&vec![0.5; 4 * 256], 4, 256).unwrap();
        for kernel in [Kernel::Lut, Kernel::Gemm, Kernel::SignFlip] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut x = vec![1.0; 2 * 256];
                x[256 + 200] = bad;
                let err = m.matmul(&x, 2, &mut [0.0; 8], kernel, Isa::Neon, &Pool::new(1));
                let ok = err.as_ref().is_err_and(|e| e.to_string().contains("(1, 200)"));
                checks.check(ok, || format!("{kernel:?} with {bad} in the input: {err:?}"));
            }
        }
    }

    /// Random blocks with random signs and random finite fp16 scales whose bits are within `mask`
    /// (`0x83ff`: zeros and subnormals only).
    fn random_blocks(rng: &mut Rng, blocks: usize, mask: u16) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(blocks * BLOCK_BYTES);
        for _ in 0..blocks {
            let mut d = rng.next_u64() as u16 & mask;
            if d & 0x7c00 == 0x7c00 {
                d &= !0x4000; // an infinite or NaN exponent becomes a finite one
            }
            bytes.extend_from_slice(&d.to_le_bytes());
            bytes.extend_from_slice(&rng.next_u64().to_le_bytes());
            bytes.extend_from_slice(&rng.next_u64().to_le_bytes());
        }
        bytes
    }

    fn rel_err(y: &[f32], exact: &[f64]) -> f64 {
        let num: f64 = y.iter().zip(exact).map(|(&a, &b)| (f64::from(a) - b).powi(2)).sum();
        let den: f64 = exact.iter().map(|b| b * b).sum();
        (num / den.max(1e-300)).sqrt()
    }

    fn bits(y: &[f32]) -> Vec<u32> {
        y.iter().map(|v| v.to_bits()).collect()
    }

    fn matmul(m: &Q1Matrix, x: &[f32], n: usize, kernel: Kernel, isa: Isa) -> Vec<f32> {
        let mut out = vec![f32::NAN; n * m.rows()];
        m.matmul(x, n, &mut out, kernel, isa, &Pool::new(1)).unwrap();
        out
    }

    fn check_case(checks: &mut Checks, m: &Q1Matrix, x: &[f32], n: usize, case: &str) {
        let cols = m.cols();
        let scalar = quantize_acts(x, n, cols, Isa::Scalar).unwrap();
        let neon = quantize_acts(x, n, cols, Isa::Neon).unwrap();
        checks.check(neon == scalar, || format!("{case}: quantize_acts differs"));
        for i in 0..n {
            let mut want = vec![0u8; cols / 4 * TABLE_BYTES];
            let mut got = want.clone();
            build_tables(scalar.row(i), &mut want, Isa::Scalar);
            build_tables(scalar.row(i), &mut got, Isa::Neon);
            checks.check(got == want, || format!("{case}: build_tables differs for row {i}"));
        }
        let exact = exact_quantized(m.blocks(), m.rows(), &scalar);
        let first = bits(&matmul(m, x, n, Kernel::Lut, Isa::Scalar));
        for kernel in QUANTIZED_KERNELS {
            let scalar_y = matmul(m, x, n, kernel, Isa::Scalar);
            let neon_y = matmul(m, x, n, kernel, Isa::Neon);
            let err = rel_err(&neon_y, &exact);
            checks.check(err < 1e-5, || format!("{case} {kernel:?}: relative error {err:e} vs exact"));
            checks.check(bits(&neon_y) == bits(&scalar_y), || format!("{case} {kernel:?}: NEON != scalar"));
            checks.check(bits(&neon_y) == first, || format!("{case} {kernel:?}: NEON != scalar LUT"));
        }
    }
}

//! Times the small GEMMs (`amx-gemm`, `vnni-gemm`, `perm-gemm`, `lut-gemm`) against the LUT GEMV at
//! n = 1, over memory-resident Q1_0 matrices (`MIB`, default 128 MiB of distinct copies; `MIB=0`: one
//! matrix, cache-resident), kernels taken in turn round by round, best of `REPS` (default 7) laps
//! each; prints µs per call and the per-row cost over the n = 1 GEMV. The Python-free counterpart of
//! `benches/gemm_ab.py`. `KERNELS=perm-gemm,vnni-gemm` times only those.
//!
//!     [MIB=128] [REPS=7] [KERNELS=...] cargo run --release -p oxibonsai-core --example gemm_speed -- rows cols threads n...

use std::time::Instant;

use oxibonsai_core::pool::Pool;
use oxibonsai_core::q1::{Isa, Kernel, Q1Matrix};

const KERNELS: [(&str, Kernel); 4] = [
    ("amx-gemm", Kernel::AmxGemm),
    ("vnni-gemm", Kernel::VnniGemm),
    ("perm-gemm", Kernel::PermGemm),
    ("lut-gemm", Kernel::LutGemm),
];

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).map(|v| v.parse().expect("a number")).unwrap_or(default)
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numbers")).collect();
    let (rows, cols) = (args.first().copied().unwrap_or(2048), args.get(1).copied().unwrap_or(2048));
    let threads = args.get(2).copied().unwrap_or(1);
    let ns = if args.len() > 3 { args[3..].to_vec() } else { vec![4, 16, 64] };
    let w: Vec<f32> = (0..rows * cols).map(|i| ((i as f32) * 0.618).sin()).collect();
    let base = Q1Matrix::quantize(&w, rows, cols).unwrap();
    let count = ((env("MIB", 128) << 20) / base.as_bytes().len()).max(1);
    let mats: Vec<Q1Matrix> =
        (0..count).map(|_| Q1Matrix::from_bytes(base.as_bytes().to_vec(), rows, cols).unwrap()).collect();
    let max_n = ns.iter().copied().max().unwrap_or(1);
    let x: Vec<f32> = (0..max_n * cols).map(|i| ((i as f32) * 0.37).cos()).collect();
    let mut out = vec![0.0f32; max_n * rows];
    let (isa, pool) = (Isa::detect(), Pool::new(threads));
    let only = std::env::var("KERNELS").unwrap_or_default();
    let chosen: Vec<_> =
        KERNELS.iter().filter(|(name, _)| only.is_empty() || only.split(',').any(|o| o == *name)).collect();
    let mut combos = vec![(1, "lut", Kernel::Lut)];
    combos.extend(ns.iter().flat_map(|&n| chosen.iter().map(move |&&(name, k)| (n, name, k))));
    let mut best = vec![f64::INFINITY; combos.len()];
    let calls = 32usize.div_ceil(count);
    for _ in 0..env("REPS", 7) {
        for (i, &(n, _, kernel)) in combos.iter().enumerate() {
            let start = Instant::now();
            for _ in 0..calls {
                for m in &mats {
                    m.matmul(&x[..n * cols], n, &mut out[..n * rows], kernel, isa, &pool).unwrap();
                }
            }
            best[i] = best[i].min(start.elapsed().as_secs_f64() / (calls * count) as f64);
        }
    }
    println!("{rows}x{cols}, {threads} thread(s), {count} matrices; lut n=1: {:.1} us", best[0] * 1e6);
    for (i, &(n, name, _)) in combos.iter().enumerate().skip(1) {
        println!("  n={n:3} {name:10} {:9.1} us  row/n1 {:.3}", best[i] * 1e6, best[i] / n as f64 / best[0]);
    }
}

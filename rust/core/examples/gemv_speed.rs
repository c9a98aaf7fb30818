//! Times the LUT GEMV (one activation row) over memory-resident Q1_0 matrices: enough distinct copies
//! of one shape to exceed the caches (`MIB`, default 160 MiB; `MIB=0`: one matrix, cache-resident),
//! cycled through, best lap of eight, for each thread count; prints GB/s of weight data. The
//! Python-free counterpart of `benches/gemm_ab.py`.
//!
//! `ISA=avx2` (or another name `kernel_info()` lists) times that instruction set's GEMV instead of
//! the best one, e.g. the AVX2 kernel on an AVX-512 machine.
//!
//!     [MIB=160] [ISA=...] cargo run --release -p oxibonsai-core --example gemv_speed -- [rows] [cols] [threads...]

use std::time::Instant;

use oxibonsai_core::pool::Pool;
use oxibonsai_core::q1::{Isa, Kernel, Q1Matrix};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numbers")).collect();
    let (rows, cols) = (args.first().copied().unwrap_or(2048), args.get(1).copied().unwrap_or(2048));
    let threads = if args.len() > 2 { args[2..].to_vec() } else { vec![1, 2] };
    let w: Vec<f32> = (0..rows * cols).map(|i| ((i as f32) * 0.618).sin()).collect();
    let base = Q1Matrix::quantize(&w, rows, cols).unwrap();
    let mib: usize = std::env::var("MIB").map(|v| v.parse().unwrap()).unwrap_or(160);
    let count = ((mib << 20) / base.as_bytes().len()).max(1);
    let mats: Vec<Q1Matrix> =
        (0..count).map(|_| Q1Matrix::from_bytes(base.as_bytes().to_vec(), rows, cols).unwrap()).collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.37).cos()).collect();
    let mut out = vec![0.0f32; rows];
    let isa = std::env::var("ISA").map_or_else(|_| Isa::detect(), |name| Isa::parse_available(&name).expect("ISA"));
    for &t in &threads {
        let pool = Pool::new(t);
        let mut best = f64::INFINITY;
        // Laps of at least 200 GEMVs, the best of 8.
        let cycles = 200usize.div_ceil(count);
        for _ in 0..8 {
            let start = Instant::now();
            for _ in 0..cycles {
                for m in &mats {
                    m.matmul(&x, 1, &mut out, Kernel::Lut, isa, &pool).unwrap();
                }
            }
            best = best.min(start.elapsed().as_secs_f64() / (cycles * count) as f64);
        }
        let gb = base.as_bytes().len() as f64 / best / 1e9;
        println!("{rows}x{cols}, {t} thread(s): {:.1} us per GEMV, {gb:.1} GB/s", best * 1e6);
    }
}

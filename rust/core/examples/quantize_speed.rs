//! Activation quantization speed: `quantize_speed [ROWS] [COLS]`, ns per value on every ISA.
use oxibonsai_core::q1::act::quantize_acts;
use oxibonsai_core::q1::Isa;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let (n, k) = (args.first().copied().unwrap_or(512), args.get(1).copied().unwrap_or(6144));
    let x: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 97.0).collect();
    for isa in Isa::available() {
        let mut best = f64::MAX;
        for _ in 0..20 {
            let t = Instant::now();
            std::hint::black_box(quantize_acts(&x, n, k, isa).unwrap());
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{isa}: {:.3} ns per value ({n} x {k})", best * 1e9 / (n * k) as f64);
    }
}

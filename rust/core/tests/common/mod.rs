//! Test helpers: a small seeded generator (fresh seed per run, printed), random inputs, and a GGUF
//! writer ([`gguf_writer`]).

#![allow(dead_code)]

use std::time::{SystemTime, UNIX_EPOCH};

use oxibonsai_core::pool::Pool;
use oxibonsai_core::q1::{Isa, Kernel, Q1Matrix};

pub mod gguf_writer;

#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator with a fresh seed, printed so a failure can be replayed.
    pub fn fresh(test: &str) -> Rng {
        let seed = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 ^ 0x9e37_79b9_7f4a_7c15;
        println!("{test}: seed {seed}");
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }

    /// `len` normal values with a few (0.1%) outliers scaled by 20.
    pub fn activations(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| if self.uniform() < 0.001 { 20.0 * self.normal() } else { self.normal() }).collect()
    }

    pub fn weights(&mut self, len: usize) -> Vec<f32> {
        let scale = 0.01 + self.uniform();
        (0..len).map(|_| scale * self.normal()).collect()
    }
}

/// `m.matmul` of `n` activation rows `x` with `kernel` on `isa`, into a fresh output (NaN-filled first,
/// so a row the kernel skips shows).
pub fn matmul(m: &Q1Matrix, x: &[f32], n: usize, kernel: Kernel, isa: Isa, pool: &Pool) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * m.rows()];
    m.matmul(x, n, &mut out, kernel, isa, pool).unwrap();
    out
}

//! Helpers shared by the kernels' unit tests: the AVX-512 check that skips a test (saying so) and a
//! freshly seeded xorshift stream whose seed is printed, so a failure can be replayed.

/// True when the CPU has AVX-512 F and BW; otherwise prints that the test is skipped.
pub fn avx512() -> bool {
    let ok = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
    if !ok {
        println!("skipped: this CPU lacks AVX-512 F/BW");
    }
    ok
}

/// A xorshift64 stream seeded from the clock.
pub struct Xorshift(u64);

impl Xorshift {
    /// A fresh stream; `what` names it in the printed seed.
    pub fn fresh(what: &str) -> Xorshift {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
        println!("{what}: seed {seed}");
        Xorshift(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

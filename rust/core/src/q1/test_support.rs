//! Helpers shared by the kernels' unit tests: the AVX-512 check that skips a test (saying so) and a
//! freshly seeded random stream (the sampler's [`Rng`]) whose seed is printed, so a failure can be
//! replayed.

use crate::sample::Rng;

/// True when the CPU has AVX-512 F and BW; otherwise prints that the test is skipped.
pub fn avx512() -> bool {
    let ok = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
    if !ok {
        println!("skipped: this CPU lacks AVX-512 F/BW");
    }
    ok
}

/// A stream seeded from the clock; `what` names it in the printed seed.
pub fn fresh_rng(what: &str) -> Rng {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    println!("{what}: seed {seed}");
    Rng::new(seed)
}

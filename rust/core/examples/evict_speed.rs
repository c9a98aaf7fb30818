//! Times `PrefixCache::evict` of one idle chain of `B` blocks (default 64), the Rust side of the
//! `evict` group of `benches/bench_prefix_cache.py` without Python: fill a fresh cache with a chain,
//! release it, time evicting all of it; best of many rounds.
//!
//!     [B=64] cargo run --release -p oxibonsai-core --example evict_speed

use std::time::Instant;

use oxibonsai_core::kv::{PrefixCache, BLOCK_TOKENS};

fn main() {
    let blocks: usize = std::env::var("B").map(|v| v.parse().expect("a number")).unwrap_or(64);
    let tokens: Vec<u32> =
        (0..(blocks * BLOCK_TOKENS) as u32).map(|i| i.wrapping_mul(2_654_435_761) % 150_000).collect();
    let mut best = f64::INFINITY;
    for _ in 0..(1_300_000 / blocks).max(20) {
        let mut cache = PrefixCache::new(blocks, 0);
        let mut held: Vec<u32> = (0..blocks).map(|_| cache.allocate().expect("room")).collect();
        cache.insert_chain(&tokens, &mut held, None).expect("a fresh chain");
        for &b in &held {
            cache.release(b).expect("held");
        }
        let start = Instant::now();
        let evicted = cache.evict(blocks);
        best = best.min(start.elapsed().as_secs_f64());
        assert_eq!(evicted.len(), blocks);
    }
    println!("evict {blocks} blocks: {:.3} us (best)", best * 1e6);
}

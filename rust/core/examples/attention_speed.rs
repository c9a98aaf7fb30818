//! Times one decode token's attention over every layer of a Bonsai-1.7B-shaped KV cache (28 layers,
//! 16 query heads over 8 KV heads of 128; f16, or f32 / int8 with a fourth argument) at a given
//! context, the sequence's blocks scattered through a larger pool as they are after other requests
//! came and went.
//!
//!     cargo run --release -p oxibonsai-core --example attention_speed -- [context] [threads] [reps] [f16|f32|int8]

use std::time::Instant;

use oxibonsai_core::kv::{KvCache, KvLayout, BLOCK_TOKENS, F16, I8};
use oxibonsai_core::model::attention::AttendElem;
use oxibonsai_core::model::attention::{attend, AttentionShape, TokenSlot};
use oxibonsai_core::pool::Pool;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.get(3).map(String::as_str) {
        Some("f32") => time::<f32>(&args[..3]),
        Some("int8") => time::<I8>(&args[..3]),
        None | Some("f16") => time::<F16>(&args[..args.len().min(3)]),
        Some(other) => panic!("the KV type is f16, f32 or int8, got {other}"),
    }
}

fn time<E: AttendElem>(args: &[String]) {
    let args: Vec<usize> = args.iter().map(|a| a.parse().expect("numbers")).collect();
    let (context, threads, reps) =
        (args.first().copied().unwrap_or(512), args.get(1).copied().unwrap_or(1), args.get(2).copied().unwrap_or(50));
    let layout = KvLayout { n_layers: 28, n_kv_heads: 8, head_dim: 128 };
    let shape = AttentionShape { n_heads: 16, group: 2, head_dim: 128 };
    let blocks = context.div_ceil(BLOCK_TOKENS);
    let pool_blocks = 4 * blocks;
    let mut cache = KvCache::<E>::new(layout, pool_blocks).unwrap();
    // Every fourth block, backwards.
    let table: Vec<u32> = (0..blocks).map(|b| (pool_blocks - 1 - 4 * b) as u32).collect();
    let kv: Vec<f32> = (0..1024).map(|i| (i as f32 * 0.37).sin()).collect();
    for layer in 0..layout.n_layers {
        for pos in 0..context {
            cache.write(layer, table[pos / BLOCK_TOKENS] as usize, pos % BLOCK_TOKENS, &kv, &kv);
        }
    }
    let q: Vec<f32> = (0..2048).map(|i| (i as f32 * 0.11).cos()).collect();
    let slots = [TokenSlot { pos: context - 1, block_table: &table }];
    let mut out = vec![0.0f32; 2048];
    let pool = Pool::new(threads);
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let start = Instant::now();
        for layer in 0..layout.n_layers {
            attend(layer, &q, &slots, &shape, &cache, &mut out, &pool);
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    let bytes = (blocks * layout.block_bytes::<E>()) as f64;
    println!(
        "{} context {context}, {threads} thread(s): best {:.3} ms per token, {:.1} GB/s of K+V (and row scales)",
        E::NAME,
        best * 1e3,
        bytes / best / 1e9
    );
}

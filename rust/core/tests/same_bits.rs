//! The same bits on every CPU: attention over fixed f16, f32 and int8 caches, and the embedded default
//! model's logits and greedy tokens, hashed and held to constants. Every kernel adds in one defined
//! order (the attention module doc, the exact integer block sums of the Q1 kernels), so an x86-64
//! machine with AVX-512, one with AVX2, the scalar build and an aarch64 one (NEON matmuls, the
//! generic attention loop) must all print the same hashes. The inputs are fixed, unlike the other
//! tests': a result computed elsewhere is what is checked.
//!
//! Runs under qemu-user on x86-64 hosts too (`../shared/tools/arm64-test -p oxibonsai-core --test
//! same_bits`), where spawned threads hang: so this is a `harness = false` target whose `main` runs
//! every check on the main thread with 1-thread pools, and panics at the end if any check failed.
//! After a deliberate change of the arithmetic, the constants are what it prints.

use std::path::Path;

use oxibonsai_core::gguf::GgufFile;
use oxibonsai_core::kv::{KvCache, KvLayout, BLOCK_TOKENS, F16, I8};
use oxibonsai_core::model::attention::{attend, AttendElem, AttentionShape, TokenSlot};
use oxibonsai_core::model::{KvDtype, MatmulPlan, ModelRunner, Qwen3Model};
use oxibonsai_core::pool::Pool;
use oxibonsai_core::q1::{Isa, Kernel};
use oxibonsai_core::step::{Logits, StepItem};

/// (KV type, head dim, query heads per KV head, attention hash).
const ATTENTION: [(&str, usize, usize, u64); 5] = [
    ("f16", 128, 2, 0x3bbd_02e4_7d70_3e0c),
    ("f16", 64, 4, 0x7108_f6ff_cc22_460f),
    ("f16", 132, 3, 0x7257_19c7_9dc1_fe40),
    ("f32", 128, 2, 0xb76e_31f1_427a_58a0),
    ("int8", 128, 2, 0x596d_8e46_97ad_0acf),
];
/// The default model: prefill of [`prompt`], then greedy decode steps.
const MODEL_LOGITS: u64 = 0xe48f_66ed_17f2_49cb;
const MODEL_TOKENS: [u32; 8] = [264, 4014, 16, 308, 267, 841, 3365, 1079];

fn main() {
    let mut failed = Vec::new();
    for (dtype, d, group, want) in ATTENTION {
        let got = match dtype {
            "f16" => attention_hash::<F16>(d, group),
            "int8" => attention_hash::<I8>(d, group),
            _ => attention_hash::<f32>(d, group),
        };
        println!("attention {dtype} d {d} group {group}: {got:#018x}");
        if got != want {
            failed.push(format!("attention {dtype} d {d} group {group}: {got:#018x}, want {want:#018x}"));
        }
    }
    for isa in Isa::available() {
        let (logits, tokens) = model_run(isa);
        println!(
            "default model, {isa:?} matmuls, attention {:?}: logits {logits:#018x}, tokens {tokens:?}",
            Isa::detect()
        );
        if (logits, tokens) != (MODEL_LOGITS, MODEL_TOKENS) {
            failed.push(format!("default model, {isa:?}: logits {logits:#018x} tokens {tokens:?}"));
        }
    }
    println!("{} passed, {} failed", ATTENTION.len() + Isa::available().len() - failed.len(), failed.len());
    assert!(failed.is_empty(), "results differ from the constants:\n{}", failed.join("\n"));
}

/// FNV-1a over the bits of `values`.
fn hash(values: &[f32], mut h: u64) -> u64 {
    for v in values {
        for byte in v.to_bits().to_le_bytes() {
            h = (h ^ byte as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// A fixed value in [-4, 4) for index `i` of stream `salt`: exact integer arithmetic, no libm.
fn value(i: usize, salt: u64) -> f32 {
    let mut z = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ salt;
    z = (z ^ (z >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^= z >> 32;
    ((z & 0xffff) as f32 - 32768.0) / 8192.0
}

/// Attention of every position of a 45-token sequence (blocks in reverse order in the pool) over two
/// KV heads, hashed.
fn attention_hash<E: AttendElem>(d: usize, group: usize) -> u64 {
    let tokens: usize = 45;
    let blocks = tokens.div_ceil(BLOCK_TOKENS);
    let layout = KvLayout { n_layers: 1, n_kv_heads: 2, head_dim: d };
    let mut cache = KvCache::<E>::new(layout, blocks + 2).unwrap();
    let table: Vec<u32> = (0..blocks as u32).map(|b| blocks as u32 + 1 - b).collect();
    for t in 0..tokens {
        let k: Vec<f32> = (0..2 * d).map(|i| value(t * 2 * d + i, 1)).collect();
        let v: Vec<f32> = (0..2 * d).map(|i| value(t * 2 * d + i, 2)).collect();
        cache.write(0, table[t / BLOCK_TOKENS] as usize, t % BLOCK_TOKENS, &k, &v);
    }
    let shape = AttentionShape { n_heads: 2 * group, group, head_dim: d };
    let q: Vec<f32> = (0..tokens * 2 * group * d).map(|i| value(i, 3) / 8.0).collect();
    let slots: Vec<TokenSlot> = (0..tokens).map(|pos| TokenSlot { pos, block_table: &table }).collect();
    let mut out = vec![0.0f32; q.len()];
    attend(0, &q, &slots, &shape, &cache, &mut out, &Pool::new(1));
    hash(&out, FNV_START)
}

/// The prompt: 24 fixed token ids of the default model's vocabulary.
fn prompt(vocab: usize) -> Vec<u32> {
    (0..24).map(|i| ((i as u64 * 2_654_435_761 + 17) % vocab as u64) as u32).collect()
}

/// The embedded default model with `isa`'s matmuls on an f16 cache: the hash of every prefill logit
/// and each decode step's, and the greedy tokens.
fn model_run(isa: Isa) -> (u64, [u32; 8]) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/oxibonsai/models/oxibonsai-default-q1.gguf");
    let file = GgufFile::open(&path).unwrap();
    let model = Qwen3Model::from_gguf(&file, MatmulPlan { kernel: Kernel::Auto, isa }).unwrap();
    let vocab = model.config.vocab;
    let mut runner = ModelRunner::new(model, 8, 256, KvDtype::F16).unwrap();
    let pool = Pool::new(1);
    let seq = runner.table_mut().add_sequence();
    let mut feed = prompt(vocab);
    let mut logits = Logits::All;
    let mut h = FNV_START;
    let mut tokens = [0u32; 8];
    for token in tokens.iter_mut() {
        let rows = runner.step(&[StepItem::new(seq, &feed, logits)], &pool).unwrap();
        h = hash(&rows, h);
        *token = argmax(&rows[rows.len() - vocab..]);
        feed = vec![*token];
        logits = Logits::Last;
    }
    (h, tokens)
}

/// The first index of the largest value.
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

//! The Qwen3 runner on a tiny random GGUF built in memory: prefill/decode splits and thread counts
//! never change a bit, failed steps change nothing, and every block comes back.

mod common;

use common::gguf_writer::{build, TensorSpec};
use common::Rng;
use oxibonsai_core::bytes::SharedBytes;
use oxibonsai_core::gguf::{GgufFile, Value};
use oxibonsai_core::model::{KvDtype, MatmulPlan, ModelRunner, Qwen3Model};
use oxibonsai_core::pool::Pool;
use oxibonsai_core::q1::{format::quantize, Isa, Kernel};
use oxibonsai_core::step::{Logits, StepItem};
use oxibonsai_core::Error;

const HIDDEN: u64 = 128;
const HEADS: u64 = 2;
const KV_HEADS: u64 = 1;
const HEAD_DIM: u64 = 128;
const FFN: u64 = 256;
const VOCAB: u64 = 64;
const LAYERS: u64 = 2;

fn q1(rng: &mut Rng, name: &str, rows: u64, cols: u64) -> TensorSpec {
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal() / (cols as f32).sqrt()).collect();
    TensorSpec::new(name, &[cols, rows], 41, quantize(&w, rows as usize, cols as usize).unwrap())
}

fn norm(rng: &mut Rng, name: &str, len: u64) -> TensorSpec {
    let bytes = (0..len).flat_map(|_| (1.0 + 0.1 * rng.normal()).to_le_bytes()).collect();
    TensorSpec::new(name, &[len], 0, bytes)
}

fn tiny_model(rng: &mut Rng) -> Qwen3Model {
    let kvs = [
        ("general.architecture", Value::String("qwen3".into())),
        ("qwen3.block_count", Value::U32(LAYERS as u32)),
        ("qwen3.context_length", Value::U32(256)),
        ("qwen3.embedding_length", Value::U32(HIDDEN as u32)),
        ("qwen3.feed_forward_length", Value::U32(FFN as u32)),
        ("qwen3.attention.head_count", Value::U32(HEADS as u32)),
        ("qwen3.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("qwen3.attention.key_length", Value::U32(HEAD_DIM as u32)),
        ("qwen3.rope.freq_base", Value::F32(1e6)),
        ("qwen3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
    ];
    let mut tensors = vec![q1(rng, "token_embd.weight", VOCAB, HIDDEN), norm(rng, "output_norm.weight", HIDDEN)];
    for i in 0..LAYERS {
        let n = |t: &str| format!("blk.{i}.{t}.weight");
        tensors.extend([
            norm(rng, &n("attn_norm"), HIDDEN),
            q1(rng, &n("attn_q"), HEADS * HEAD_DIM, HIDDEN),
            q1(rng, &n("attn_k"), KV_HEADS * HEAD_DIM, HIDDEN),
            q1(rng, &n("attn_v"), KV_HEADS * HEAD_DIM, HIDDEN),
            q1(rng, &n("attn_output"), HIDDEN, HEADS * HEAD_DIM),
            norm(rng, &n("attn_q_norm"), HEAD_DIM),
            norm(rng, &n("attn_k_norm"), HEAD_DIM),
            norm(rng, &n("ffn_norm"), HIDDEN),
            q1(rng, &n("ffn_gate"), FFN, HIDDEN),
            q1(rng, &n("ffn_up"), FFN, HIDDEN),
            q1(rng, &n("ffn_down"), HIDDEN, FFN),
        ]);
    }
    let file = GgufFile::from_bytes(SharedBytes::from_vec(build(&kvs, &tensors, 32))).unwrap();
    Qwen3Model::from_gguf(&file, MatmulPlan { kernel: Kernel::Auto, isa: Isa::detect() }).unwrap()
}

fn tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % VOCAB) as u32).collect()
}

fn step(runner: &mut ModelRunner, seq: u64, toks: &[u32], logits: Logits, pool: &Pool) -> Vec<f32> {
    runner.step(&[StepItem::new(seq, toks, logits)], pool).unwrap()
}

#[test]
fn prefill_decode_splits_and_thread_counts_give_identical_logits() {
    let mut rng = Rng::fresh("model_splits");
    let mut runner = ModelRunner::new(tiny_model(&mut rng), 64, 256, KvDtype::F16).unwrap();
    let toks = tokens(&mut rng, 40);
    let one = Pool::new(1);
    let seq = runner.table_mut().add_sequence();
    let full = step(&mut runner, seq, &toks, Logits::All, &one);
    assert_eq!(full.len(), toks.len() * VOCAB as usize);
    for threads in [1, 2, 3] {
        let pool = Pool::new(threads);
        let seq = runner.table_mut().add_sequence();
        let cut = 1 + (rng.next_u64() % 39) as usize;
        let mut rows = step(&mut runner, seq, &toks[..cut], Logits::All, &pool);
        for t in &toks[cut..] {
            rows.extend(step(&mut runner, seq, &[*t], Logits::Last, &pool));
        }
        assert!(rows.iter().zip(&full).all(|(a, b)| a.to_bits() == b.to_bits()), "threads {threads} cut {cut}");
    }
}

#[test]
fn a_failed_step_changes_nothing_and_blocks_come_back() {
    let mut rng = Rng::fresh("model_failures");
    let mut runner = ModelRunner::new(tiny_model(&mut rng), 4, 256, KvDtype::F32).unwrap();
    let pool = Pool::new(2);
    let a = runner.table_mut().add_sequence();
    step(&mut runner, a, &tokens(&mut rng, 20), Logits::Last, &pool);
    let b = runner.table_mut().add_sequence();
    let too_many = tokens(&mut rng, 50);
    let err = runner.step(&[StepItem::new(b, &too_many, Logits::Last)], &pool).unwrap_err();
    assert!(matches!(err, Error::Value(ref m) if m.contains("KV cache is full")), "{err:?}");
    let bad = [VOCAB as u32];
    assert!(runner.step(&[StepItem::new(a, &bad, Logits::Last)], &pool).is_err());
    assert!(runner.step(&[StepItem::new(999, &bad[..0], Logits::Last)], &pool).is_err());
    assert_eq!(runner.table().sequence_len(a).unwrap(), 20);
    assert_eq!(runner.table().sequence_len(b).unwrap(), 0);
    runner.table_mut().free_sequence(a).unwrap();
    runner.table_mut().free_sequence(b).unwrap();
    assert_eq!(runner.table().num_free_blocks(), 4);
    assert!(runner.table_mut().free_sequence(a).is_err());
}

#[test]
fn the_context_limit_is_enforced() {
    let mut rng = Rng::fresh("model_context");
    let mut runner = ModelRunner::new(tiny_model(&mut rng), 64, 32, KvDtype::F16).unwrap();
    let pool = Pool::new(1);
    let seq = runner.table_mut().add_sequence();
    let err = runner.step(&[StepItem::new(seq, &tokens(&mut rng, 33), Logits::Last)], &pool);
    assert!(matches!(err, Err(Error::Value(ref m)) if m.contains("max_model_len=32")));
    assert!(ModelRunner::new(tiny_model(&mut rng), 64, 1000, KvDtype::F32).is_err());
}

/// Prefills `prompt` in a sequence started on its cached prefix; returns the last logits row and the
/// number of cached tokens, and frees the sequence.
fn cached_run(runner: &mut ModelRunner, prompt: &[u32], salt: Option<&str>, pool: &Pool) -> (Vec<f32>, usize) {
    let (seq, cached) = runner.table_mut().add_sequence_cached(prompt, salt);
    let logits = step(runner, seq, &prompt[cached..], Logits::Last, pool);
    runner.table_mut().free_sequence(seq).unwrap();
    (logits, cached)
}

#[test]
fn a_cached_prefix_gives_the_same_logits_as_computing_it() {
    let mut rng = Rng::fresh("model_prefix");
    let mut runner = ModelRunner::new(tiny_model(&mut rng), 64, 256, KvDtype::F16).unwrap();
    let pool = Pool::new(2);
    let shared = tokens(&mut rng, 40);
    let mut long = shared.clone();
    long.extend(tokens(&mut rng, 9));
    let uncached = |runner: &mut ModelRunner, p: &[u32]| {
        let seq = runner.table_mut().add_sequence();
        let l = step(runner, seq, p, Logits::Last, &pool);
        runner.table_mut().free_sequence(seq).unwrap();
        l
    };
    let want_shared = uncached(&mut runner, &shared);
    let want_long = uncached(&mut runner, &long);
    assert_eq!(runner.table().cache_stats().cached_blocks, 0, "plain sequences are not cached");
    assert_eq!(cached_run(&mut runner, &shared, None, &pool), (want_shared.clone(), 0));
    let before = runner.computed_tokens();
    assert_eq!(cached_run(&mut runner, &long, None, &pool), (want_long, 32));
    assert_eq!(runner.computed_tokens() - before, 17);
    // The whole prompt is cached now: its last token is still computed, in a private block.
    assert_eq!(cached_run(&mut runner, &long[..48], None, &pool).1, 32);
    assert_eq!(cached_run(&mut runner, &shared, None, &pool), (want_shared, 32));
    assert_eq!(cached_run(&mut runner, &shared, Some("other tenant"), &pool).1, 0);
    let stats = runner.table().cache_stats();
    assert_eq!((stats.queries, stats.hits, stats.free_blocks + stats.cached_blocks), (5, 3, 64));
}

#[test]
fn a_tiny_pool_evicts_instead_of_running_out() {
    let mut rng = Rng::fresh("model_prefix_evict");
    let mut runner = ModelRunner::new(tiny_model(&mut rng), 4, 256, KvDtype::F32).unwrap();
    let pool = Pool::new(1);
    for _ in 0..6 {
        let prompt = tokens(&mut rng, 60);
        cached_run(&mut runner, &prompt, None, &pool);
        assert_eq!(runner.table().num_available_blocks(), 4);
    }
    assert!(runner.table().cache_stats().evictions >= 10);
    runner.table_mut().set_prefix_caching(false);
    assert_eq!((runner.table().num_free_blocks(), runner.table().cache_stats().cached_blocks), (4, 0));
    let prompt = tokens(&mut rng, 20);
    assert_eq!(cached_run(&mut runner, &prompt, None, &pool).1, 0);
    assert_eq!(runner.table().cache_stats().cached_blocks, 0);
}

#[test]
fn hidden_states_are_what_the_lm_head_reads() {
    let mut rng = Rng::fresh("model_hidden");
    let mut runner = ModelRunner::new(tiny_model(&mut rng), 64, 256, KvDtype::F16).unwrap();
    let pool = Pool::new(2);
    let n = 1 + (rng.next_u64() % 40) as usize;
    let toks = tokens(&mut rng, n);
    let seq = runner.table_mut().add_sequence();
    let logits = step(&mut runner, seq, &toks, Logits::All, &pool);
    let seq = runner.table_mut().add_sequence();
    let mut hidden = Vec::new();
    runner.hidden_into(&[StepItem::new(seq, &toks, Logits::All)], &pool, &mut hidden).unwrap();
    let width = runner.model().config.hidden;
    assert_eq!(hidden.len(), toks.len() * width);
    let mut again = vec![0.0; logits.len()];
    let model = runner.model();
    model.weights.lm_head().forward(&hidden, toks.len(), &mut again, model.plan, &pool).unwrap();
    assert!(again.iter().zip(&logits).all(|(a, b)| a.to_bits() == b.to_bits()));
    let seq = runner.table_mut().add_sequence();
    let mut last = Vec::new();
    runner.hidden_into(&[StepItem::new(seq, &toks, Logits::Last)], &pool, &mut last).unwrap();
    assert_eq!(last, hidden[hidden.len() - width..]);
}

#[test]
fn a_saved_prefix_cache_loads_into_a_runner_of_the_same_model_only() {
    let mut rng = Rng::fresh("model_cache_file");
    let (mut same_weights, pool) = (rng.clone(), Pool::new(2));
    let mut writer = ModelRunner::new(tiny_model(&mut rng), 32, 256, KvDtype::F16).unwrap();
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| tokens(&mut rng, 40 + 9 * i)).collect();
    let want: Vec<Vec<f32>> = prompts.iter().map(|p| cached_run(&mut writer, p, None, &pool).0).collect();
    let path = std::env::temp_dir().join(format!("oxibonsai-cache-file-{}.bin", rng.next_u64()));
    let saved = writer.save_prefix_cache(&path).unwrap();
    assert_eq!(saved, writer.table().cache_stats().cached_blocks);
    let mut reader = ModelRunner::new(tiny_model(&mut same_weights), 32, 256, KvDtype::F16).unwrap();
    assert_eq!(reader.identity(), writer.identity());
    assert_eq!(reader.load_prefix_cache(&path).unwrap(), saved);
    for (p, want) in prompts.iter().zip(&want) {
        let (logits, cached) = cached_run(&mut reader, p, None, &pool);
        assert_eq!(cached, 16 * ((p.len() - 1) / 16));
        assert!(logits.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    let mut other = ModelRunner::new(tiny_model(&mut rng), 32, 256, KvDtype::F16).unwrap();
    let err = other.load_prefix_cache(&path).unwrap_err();
    assert!(matches!(err, Error::Value(ref m) if m.contains("another model")), "{err:?}");
    let mut exact = ModelRunner::new(tiny_model(&mut rng.clone()), 32, 256, KvDtype::F32).unwrap();
    assert!(exact.load_prefix_cache(&path).is_err());
    assert_eq!(other.table().cache_stats().cached_blocks + exact.table().cache_stats().cached_blocks, 0);
    std::fs::remove_file(&path).unwrap();
}

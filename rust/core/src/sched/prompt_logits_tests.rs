//! Requests that want their prompt's logprobs: they start without the prefix cache, every prompt
//! row's logits come back (chunked, and again after a preemption), and [`Scheduler::logit_rows`]
//! says where each row sits among the step's logits.

use std::collections::HashMap;

use super::*;
use crate::kv::SequenceTable;
use crate::sample::Rng;
use crate::step::Logits;

fn config(max_num_seqs: usize, max_num_batched_tokens: usize) -> SchedulerConfig {
    SchedulerConfig { max_num_seqs, max_num_batched_tokens, ..Default::default() }
}

/// Rows the model returns for the step's items (what `ModelRunner::step` would give).
fn rows_returned(s: &Scheduler, out: &SchedulerOutput) -> usize {
    let items = s.step_items(out).unwrap();
    items
        .iter()
        .map(|it| match it.logits {
            Logits::None => 0,
            Logits::Last => 1,
            Logits::All => it.tokens.len(),
        })
        .sum()
}

/// Runs a scheduled step over `kv` as a runner does, sampling `token` for every sampling item.
fn run(s: &mut Scheduler, kv: &mut SequenceTable, out: &SchedulerOutput, token: u32) {
    let items: Vec<(u64, Vec<u32>)> =
        s.step_items(out).unwrap().iter().map(|it| (it.seq, it.tokens.to_vec())).collect();
    let growth: Vec<(u64, usize)> = items.iter().map(|(seq, t)| (*seq, t.len())).collect();
    kv.reserve(&growth).unwrap();
    for (seq, tokens) in &items {
        kv.append(*seq, tokens).unwrap();
    }
    s.update(out, &vec![token; out.num_sample()]).unwrap();
    s.check(kv).unwrap();
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 1000 + i).collect()
}

#[test]
fn a_prompt_logprobs_request_skips_the_cache_and_gets_every_prompt_row() {
    let mut kv = SequenceTable::new(64, 0, true);
    let mut s = Scheduler::new(config(4, 16)).unwrap();
    s.add(1, prompt(40), 0, None).unwrap();
    while s.request(1).unwrap().tokens.len() == 40 {
        let out = s.schedule(&mut kv);
        run(&mut s, &mut kv, &out, 7);
    }
    s.finish(1, &mut kv);
    // The same prompt again, scored: none of its 32 cached tokens may come from the cache.
    s.add(2, prompt(40), 0, None).unwrap();
    s.want_prompt_logprobs(2, 3).unwrap();
    let mut spans = vec![];
    loop {
        let out = s.schedule(&mut kv);
        let rows = s.logit_rows(&out);
        assert_eq!(rows.total, rows_returned(&s, &out));
        assert_eq!(rows.sample.len(), out.num_sample());
        let it = out.items[0];
        if it.start >= 40 {
            assert!(!it.prompt_logits && rows.prompt.is_empty(), "decodes return their last row only");
            assert_eq!(rows.sample, vec![0]);
            break;
        }
        assert!(it.prompt_logits);
        let p = &rows.prompt[0];
        assert_eq!((p.request, p.start, p.first_row, p.top), (2, it.start, 0, 3));
        assert_eq!(p.targets, prompt(40)[it.start + 1..(it.start + 1 + p.targets.len())]);
        spans.push((it.start, p.targets.len(), rows.sample.clone()));
        run(&mut s, &mut kv, &out, 7);
    }
    assert_eq!(spans, vec![(0, 16, vec![]), (16, 16, vec![]), (32, 7, vec![7])]);
    assert!(s.prompt_logprobs.is_empty(), "forgotten once its prompt is scored");
    // Without the request for logprobs the prompt starts on its cached blocks.
    s.add(3, prompt(40), 0, None).unwrap();
    let out = s.schedule(&mut kv);
    let third = out.items.iter().find(|it| it.request == 3).unwrap();
    assert_eq!((third.start, third.prompt_logits), (32, false));
}

#[test]
fn only_a_waiting_request_that_never_ran_can_ask() {
    let mut kv = SequenceTable::new(16, 0, true);
    let mut s = Scheduler::new(config(2, 64)).unwrap();
    assert!(s.want_prompt_logprobs(5, 1).is_err(), "unknown id");
    s.add(5, prompt(3), 0, None).unwrap();
    let out = s.schedule(&mut kv);
    run(&mut s, &mut kv, &out, 7);
    assert!(s.want_prompt_logprobs(5, 1).is_err(), "already running");
    s.add(6, prompt(1), 0, None).unwrap();
    s.want_prompt_logprobs(6, 1).unwrap();
    assert!(!s.prompt_logprobs.contains_key(&6), "a one-token prompt has nothing to score");
}

/// Random workloads mixing scored and plain requests in a small pool (so preemptions happen): the
/// row layout always matches the rows the model returns, every target is the next prompt token,
/// every prompt position is scored before the request's first token, and nothing leaks.
#[test]
fn random_workloads_score_every_prompt_position() {
    let base = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    for case in 0..60 {
        random_workload(base.wrapping_add(case));
    }
}

fn random_workload(seed: u64) {
    let mut rng = Rng::new(seed);
    let mut below = |n: u64| rng.next_u64() % n;
    let blocks = 8 + below(24) as usize;
    let mut kv = SequenceTable::new(blocks, 0, below(2) == 0);
    let seqs = 1 + below(5) as usize;
    let mut s = Scheduler::new(config(seqs, seqs + below(48) as usize)).unwrap();
    let mut prompts: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut scored: HashMap<u64, Vec<bool>> = HashMap::new();
    for id in 0..200u64 {
        if below(3) == 0 {
            let len = 1 + below((blocks * 16 / 2) as u64 - 1) as usize;
            let shared = below(2) as u32;
            let p: Vec<u32> = (0..len as u32).map(|i| if i < 24 { shared } else { i }).collect();
            s.add(id, p.clone(), below(3) as i32 - 1, None).unwrap();
            if below(2) == 0 {
                s.want_prompt_logprobs(id, below(4) as usize).unwrap();
                scored.insert(id, vec![false; len - 1]);
            }
            prompts.insert(id, p);
        }
        let out = s.schedule(&mut kv);
        let rows = s.logit_rows(&out);
        assert_eq!(rows.total, rows_returned(&s, &out), "seed {seed}");
        assert_eq!(rows.sample.len(), out.num_sample(), "seed {seed}");
        for p in &rows.prompt {
            let full = &prompts[&p.request];
            assert_eq!(p.targets, full[p.start + 1..p.start + 1 + p.targets.len()], "seed {seed}");
            assert!(p.first_row + p.targets.len() <= rows.total, "seed {seed}");
            for pos in p.start..p.start + p.targets.len() {
                scored.get_mut(&p.request).expect("only scored requests get prompt rows")[pos] = true;
            }
        }
        for it in out.items.iter().filter(|it| it.sample && it.start + it.num_tokens == prompts[&it.request].len()) {
            if let Some(done) = scored.get(&it.request) {
                assert!(
                    done.iter().all(|&d| d),
                    "seed {seed}: request {} samples before its prompt is scored",
                    it.request
                );
            }
        }
        run(&mut s, &mut kv, &out, 7);
        for id in s.running_ids() {
            if below(6) == 0 || s.request(id).unwrap().tokens.len() >= blocks * 16 / 2 {
                s.finish(id, &mut kv);
            }
        }
    }
    for id in s.running_ids().into_iter().chain(s.waiting_ids()) {
        assert!(s.finish(id, &mut kv));
    }
    assert!(s.prompt_logprobs.is_empty(), "seed {seed}: a finished request is forgotten");
    kv.reset_prefix_cache();
    assert_eq!(kv.num_free_blocks(), blocks, "seed {seed}: blocks leaked");
}

//! Scheduler tests over a model-free [`SequenceTable`]: the step rules, preemption, priorities,
//! and random workloads that must leave every block free.

use super::*;
use crate::error::Error;
use crate::kv::SequenceTable;

fn config(max_num_seqs: usize, max_num_batched_tokens: usize) -> SchedulerConfig {
    SchedulerConfig { max_num_seqs, max_num_batched_tokens, ..Default::default() }
}

/// Runs one step as the engine does, sampling token 7 for every sampling item.
fn step(s: &mut Scheduler, kv: &mut SequenceTable) -> SchedulerOutput {
    let out = s.schedule(kv);
    let items: Vec<(u64, Vec<u32>)> =
        s.step_items(&out).unwrap().iter().map(|it| (it.seq, it.tokens.to_vec())).collect();
    let growth: Vec<(u64, usize)> = items.iter().map(|(seq, t)| (*seq, t.len())).collect();
    kv.reserve(&growth).unwrap();
    for (seq, tokens) in &items {
        kv.append(*seq, tokens).unwrap();
    }
    s.update(&out, &vec![7; out.num_sample()]).unwrap();
    s.check(kv).unwrap();
    out
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).collect()
}

#[test]
fn decodes_come_first_and_long_prompts_are_chunked() {
    let mut kv = SequenceTable::new(64, 0, false);
    let mut s = Scheduler::new(config(4, 32)).unwrap();
    s.add(1, prompt(5), 0, None).unwrap();
    let out = step(&mut s, &mut kv);
    assert_eq!(out.items[0].num_tokens, 5);
    assert!(out.items[0].sample);
    s.add(2, prompt(70), 0, None).unwrap();
    let mut chunks = vec![];
    for _ in 0..3 {
        let out = step(&mut s, &mut kv);
        assert_eq!((out.items[0].request, out.items[0].num_tokens), (1, 1), "the decode goes first");
        chunks.push(out.items[1].num_tokens);
        assert_eq!(out.items[1].sample, chunks.iter().sum::<usize>() == 70);
    }
    assert_eq!(chunks, vec![31, 31, 8]);
}

#[test]
fn a_better_priority_overtakes_the_queue() {
    let mut kv = SequenceTable::new(64, 0, false);
    let mut s = Scheduler::new(config(1, 64)).unwrap();
    for id in 0..3 {
        s.add(id, prompt(4), 1, None).unwrap();
    }
    s.add(9, prompt(4), 0, None).unwrap();
    assert_eq!(s.waiting_ids(), vec![9, 0, 1, 2]);
    assert_eq!(step(&mut s, &mut kv).items[0].request, 9);
}

#[test]
fn aging_lets_an_old_low_priority_request_pass_newcomers() {
    let mut kv = SequenceTable::new(64, 0, false);
    let cfg = SchedulerConfig { priority_aging_steps: 4, ..config(1, 64) };
    let mut s = Scheduler::new(cfg).unwrap();
    s.add(0, prompt(2), 0, None).unwrap();
    step(&mut s, &mut kv); // 0 runs and keeps the only slot
    s.add(1, prompt(2), 2, None).unwrap(); // key 2*4 + 1 = 9
    for i in 0..12 {
        step(&mut s, &mut kv);
        s.add(100 + i, prompt(2), 0, None).unwrap(); // keys 2, 3, ..., 13 (ties go to the earlier arrival)
    }
    let order = s.waiting_ids();
    let pos = order.iter().position(|&id| id == 1).unwrap();
    assert_eq!(&order[..pos], &[100, 101, 102, 103, 104, 105, 106], "only newcomers with keys < 9 pass");
}

/// 4 blocks and two requests of 17 tokens, 2 blocks each: growing to 33 tokens forces a preemption.
fn two_requests_filling_four_blocks() -> (Scheduler, SequenceTable) {
    let kv = SequenceTable::new(4, 0, false);
    let mut s = Scheduler::new(config(4, 64)).unwrap();
    s.add(1, prompt(17), 0, None).unwrap();
    s.add(2, prompt(17), 0, None).unwrap();
    (s, kv)
}

#[test]
fn a_full_pool_preempts_the_worst_most_recent_request() {
    let (mut s, mut kv) = two_requests_filling_four_blocks();
    step(&mut s, &mut kv);
    assert_eq!(kv.num_free_blocks(), 0);
    for _ in 0..15 {
        assert!(step(&mut s, &mut kv).preempted.is_empty());
    }
    let out = step(&mut s, &mut kv); // token 33 needs a third block for each
    assert_eq!(out.preempted, vec![2]);
    assert_eq!(s.waiting_ids(), vec![2]);
    assert_eq!(s.request(2).unwrap().tokens.len(), 33, "a preempted request keeps what it generated");
    assert!(s.finish(1, &mut kv));
    let out = step(&mut s, &mut kv);
    assert_eq!((out.items[0].request, out.items[0].num_tokens, out.items[0].sample), (2, 33, true));
}

#[test]
fn a_plan_marks_where_each_requests_sampled_tokens_start_also_on_recompute() {
    // As above: request 2 is preempted at 33 tokens (17 of prompt), then recomputed whole.
    let (mut s, mut kv) = two_requests_filling_four_blocks();
    for _ in 0..16 {
        step(&mut s, &mut kv);
    }
    let out = s.schedule(&mut kv);
    assert_eq!(out.preempted, vec![2]);
    let plan = s.plan(&out, &mut kv).unwrap();
    assert_eq!((plan.positions.clone(), plan.decode_from.clone()), (vec![32], vec![17]), "1's decode");
    s.commit_plan(&out, &mut kv).unwrap();
    s.update(&out, &[7]).unwrap();
    assert!(s.finish(1, &mut kv));
    let out = s.schedule(&mut kv);
    let plan = s.plan(&out, &mut kv).unwrap();
    assert_eq!(plan.query_start_loc, vec![0, 33]);
    assert_eq!(plan.decode_from, vec![17], "rows 17.. of the recompute are 2's sampled tokens");
}

#[test]
fn the_waiting_queue_refuses_beyond_max_waiting() {
    let mut s = Scheduler::new(SchedulerConfig { max_waiting: Some(2), ..config(1, 8) }).unwrap();
    s.add(1, prompt(3), 0, None).unwrap();
    s.add(2, prompt(3), 0, None).unwrap();
    assert!(matches!(s.add(3, prompt(3), 0, None), Err(Error::QueueFull(_))));
    assert!(matches!(s.add(1, prompt(3), 0, None), Err(Error::Value(_))));
    assert!(matches!(s.add(4, vec![], 0, None), Err(Error::Value(_))));
    assert_eq!(s.waiting_ids(), vec![1, 2]);
}

#[test]
fn update_refuses_a_wrong_token_count_or_a_stale_output() {
    let mut kv = SequenceTable::new(8, 0, false);
    let mut s = Scheduler::new(config(2, 8)).unwrap();
    s.add(1, prompt(3), 0, None).unwrap();
    let out = s.schedule(&mut kv);
    assert!(s.update(&out, &[1, 2]).is_err());
    let stale = out.clone();
    kv.reserve(&[(out.items[0].seq, 3)]).unwrap();
    kv.append(out.items[0].seq, &prompt(3)).unwrap();
    s.update(&out, &[5]).unwrap();
    assert!(s.update(&stale, &[5]).is_err());
    assert_eq!(s.request(1).unwrap().tokens, vec![0, 1, 2, 5]);
}

#[test]
fn config_is_validated() {
    assert!(Scheduler::new(config(0, 8)).is_err());
    assert!(Scheduler::new(config(8, 4)).is_err());
    assert!(Scheduler::new(SchedulerConfig { priority_aging_steps: 0, ..config(1, 8) }).is_err());
}

/// A small deterministic generator (SplitMix64), so failures replay from the printed seed.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

fn random_workload(seed: u64, caching: bool) {
    let mut rng = Rng(seed);
    let blocks = 6 + rng.below(30) as usize;
    let mut kv = SequenceTable::new(blocks, 0, caching);
    let seqs = 1 + rng.below(6) as usize;
    let cfg = SchedulerConfig {
        chunked_prefill: rng.below(4) != 0,
        priority_aging_steps: 1 + rng.below(8),
        policy: if rng.below(2) == 0 { Policy::Priority } else { Policy::LongestPrefix },
        ..config(seqs, seqs + rng.below(40) as usize)
    };
    let budget = cfg.max_num_batched_tokens;
    let chunked = cfg.chunked_prefill;
    let mut s = Scheduler::new(cfg).unwrap();
    let mut next_id = 0;
    for _ in 0..300 {
        match rng.below(10) {
            0..=2 => {
                let max_len = (blocks * 16 / 2).min(if chunked { 200 } else { budget / 2 }).max(1);
                let len = 1 + rng.below(max_len as u64) as usize;
                let shared = rng.below(3) as u32; // few distinct prefixes, so caching hits
                let p: Vec<u32> = (0..len as u32).map(|i| if i < 20 { shared } else { i }).collect();
                s.add(next_id, p, rng.below(3) as i32 - 1, None).unwrap();
                next_id += 1;
            }
            3 => {
                s.abort(rng.below(next_id.max(1)), &mut kv);
            }
            4 => {
                if let Some(&id) = s.running_ids().first() {
                    s.finish(id, &mut kv);
                }
            }
            _ => {
                step(&mut s, &mut kv);
                // Requests that grew too long for the pool finish, as the engine's length limit does.
                for id in s.running_ids() {
                    if s.request(id).unwrap().tokens.len() >= blocks * 16 / 2 {
                        s.finish(id, &mut kv);
                    }
                }
            }
        }
    }
    for id in s.running_ids().into_iter().chain(s.waiting_ids()) {
        assert!(s.finish(id, &mut kv));
    }
    s.check(&kv).unwrap();
    assert_eq!((s.num_running(), s.num_waiting(), kv.num_sequences()), (0, 0, 0));
    kv.reset_prefix_cache();
    assert_eq!(kv.num_free_blocks(), blocks, "seed {seed}: blocks leaked");
}

#[test]
fn random_workloads_leak_nothing() {
    for seed in 0..200 {
        random_workload(seed, seed % 2 == 1);
    }
}

//! Steps planned ahead ([`Scheduler::schedule_ahead`]) against steps planned one at a time: random
//! workloads run as an engine on an asynchronous device runs them, over a simulated KV memory that
//! checks every position a step reads was written by the same request with the same token.

use std::collections::HashMap;

use super::tests::Rng;
use super::*;
use crate::kv::SequenceTable;
use crate::step::StepPlan;

/// What the fake model samples: a function of the request and its length only, so every request's
/// tokens are the same however its steps were planned.
fn model_token(id: u64, len: usize) -> u32 {
    let mut rng = Rng(id * 1_000_003 + len as u64);
    rng.below(40) as u32
}

/// Tokens that end a request, as a stop token does.
fn is_stop(token: u32) -> bool {
    token == 3
}

const PHANTOM: u32 = u32::MAX;

/// A planned step: its output, its plan, and the request of each plan row.
struct Planned {
    out: SchedulerOutput,
    plan: StepPlan,
    rows: Vec<u64>,
}

/// The engine's side: the scheduler, its table, the KV memory a device would hold (slot -> the
/// position and token written there), and the requests' limits and final tokens.
struct Sim {
    s: Scheduler,
    kv: SequenceTable,
    memory: HashMap<i64, (usize, u32)>,
    max_len: HashMap<u64, usize>,
    done: Ended,
    aborted: Ended,
}

impl Sim {
    fn plan(&mut self, out: SchedulerOutput) -> Planned {
        let rows = out
            .items
            .iter()
            .filter(|it| self.s.request(it.request).is_some_and(|r| r.seq == Some(it.seq)))
            .map(|it| it.request)
            .collect();
        let plan = self.s.plan(&out, &mut self.kv).unwrap();
        Planned { out, plan, rows }
    }

    /// Requests whose next sampled token is their last by length (the engine knows that in advance).
    fn ending_by_length(&self, step: &Planned) -> Vec<u64> {
        let sampling = step.out.items.iter().filter(|it| it.sample);
        sampling
            .filter(|it| self.s.request(it.request).is_some_and(|r| r.tokens.len() + 1 >= self.max_len[&it.request]))
            .map(|it| it.request)
            .collect()
    }

    /// What the device does with a step: every row reads its context through its block table (each
    /// position must hold its own request's token) and writes its tokens' K/V; a row whose request
    /// ended since the step was planned writes a token nobody reads.
    fn compute(&mut self, step: &Planned) {
        let p = &step.plan;
        for (row, &id) in step.rows.iter().enumerate() {
            let (first, last) = (p.query_start_loc[row] as usize, p.query_start_loc[row + 1] as usize);
            let Some(r) = self.s.request(id).filter(|r| r.seq.is_some()) else {
                for t in first..last {
                    self.memory.insert(p.slot_mapping[t], (p.positions[t] as usize, PHANTOM));
                }
                continue;
            };
            let table = &p.block_tables[row * p.max_blocks..(row + 1) * p.max_blocks];
            for pos in 0..p.positions[first] as usize {
                let slot = table[pos / 16] as i64 * 16 + (pos % 16) as i64;
                assert_eq!(self.memory.get(&slot), Some(&(pos, r.tokens[pos])), "request {id} reads position {pos}");
            }
            for t in first..last {
                let pos = p.positions[t] as usize;
                self.memory.insert(p.slot_mapping[t], (pos, r.tokens[pos]));
            }
        }
    }

    /// Computes the step, records it with the model's tokens and ends the requests whose token stops
    /// them or reaches their length.
    fn finish_step(&mut self, step: &Planned) {
        self.s.commit_plan(&step.out, &mut self.kv).unwrap();
        self.compute(step);
        let mut sampled = vec![];
        for it in step.out.items.iter().filter(|it| it.sample) {
            let r = self.s.request(it.request).filter(|r| r.seq == Some(it.seq));
            sampled.push(r.map_or(0, |r| model_token(it.request, r.tokens.len())));
        }
        self.s.update(&step.out, &sampled).unwrap();
        for it in step.out.items.iter().filter(|it| it.sample) {
            let Some(r) = self.s.request(it.request).filter(|r| r.seq == Some(it.seq)) else { continue };
            if is_stop(*r.tokens.last().unwrap()) || r.tokens.len() >= self.max_len[&it.request] {
                self.done.insert(it.request, r.tokens.clone());
                self.s.finish(it.request, &mut self.kv);
            }
        }
    }

    fn abort(&mut self, id: u64) {
        if let Some(r) = self.s.request(id) {
            self.aborted.insert(id, r.tokens.clone());
            self.s.abort(id, &mut self.kv);
        }
    }
}

/// Each request's tokens when it ended.
type Ended = HashMap<u64, Vec<u32>>;

/// A random workload (the same for both modes: its requests and when they arrive or are aborted),
/// planning ahead whenever the scheduler allows if `ahead`. Returns the finished and aborted
/// requests' tokens and how many steps were planned ahead.
fn run(seed: u64, ahead: bool) -> (Ended, Ended, usize) {
    let mut rng = Rng(seed);
    let blocks = 8 + rng.below(40) as usize;
    let seqs = 1 + rng.below(6) as usize;
    let cfg = SchedulerConfig {
        max_num_seqs: seqs,
        max_num_batched_tokens: seqs + 8 + rng.below(40) as usize,
        chunked_prefill: true,
        ..Default::default()
    };
    let caching = seed.is_multiple_of(2);
    let mut sim = Sim {
        s: Scheduler::new(cfg).unwrap(),
        kv: SequenceTable::new(blocks, 0, caching),
        memory: HashMap::new(),
        max_len: HashMap::new(),
        done: HashMap::new(),
        aborted: HashMap::new(),
    };
    let mut next_id = 0;
    let mut in_flight: Option<Planned> = None;
    let mut planned_ahead = 0;
    for _ in 0..200 {
        match rng.below(12) {
            0 | 1 => {
                let len = 1 + rng.below(40) as usize;
                let shared = rng.below(3) as u32;
                let p: Vec<u32> = (0..len as u32).map(|i| if i < 20 { shared } else { 100 + i }).collect();
                sim.max_len
                    .insert(next_id, len + 1 + rng.below((blocks * 16 / 2).saturating_sub(len) as u64 + 1) as usize);
                sim.s.add(next_id, p, 0, None).unwrap();
                next_id += 1;
            }
            2 => {
                // Between two engine calls, nothing but the step planned ahead is in flight.
                let id = rng.below(next_id.max(1));
                if in_flight.is_none() {
                    sim.abort(id);
                }
            }
            _ => {
                let step = match in_flight.take() {
                    Some(step) => step,
                    None => {
                        let out = sim.s.schedule(&mut sim.kv);
                        if out.is_empty() {
                            continue;
                        }
                        sim.plan(out)
                    }
                };
                if ahead {
                    let skip = sim.ending_by_length(&step);
                    if let Some(out) = sim.s.schedule_ahead(&step.out, &sim.kv, &skip) {
                        in_flight = Some(sim.plan(out));
                        planned_ahead += 1;
                    }
                }
                sim.finish_step(&step);
                sim.s.check(&sim.kv).unwrap();
            }
        }
    }
    if let Some(step) = in_flight.take() {
        sim.finish_step(&step);
    }
    for id in sim.s.running_ids().into_iter().chain(sim.s.waiting_ids()) {
        sim.abort(id);
    }
    sim.s.check(&sim.kv).unwrap();
    assert_eq!(sim.kv.num_sequences(), 0);
    sim.kv.reset_prefix_cache();
    assert_eq!(sim.kv.num_free_blocks(), blocks, "seed {seed}: blocks leaked");
    (sim.done, sim.aborted, planned_ahead)
}

#[test]
fn steps_planned_ahead_give_every_request_the_same_tokens() {
    let mut planned_ahead = 0;
    for seed in 0..300 {
        let (done, aborted, _) = run(seed, false);
        let (done_ahead, aborted_ahead, n) = run(seed, true);
        planned_ahead += n;
        for (id, tokens) in &done_ahead {
            // A request may finish in one mode and be aborted, earlier, in the other.
            let other = done.get(id).or(aborted.get(id)).expect("every request ends in both modes");
            assert!(tokens.starts_with(other), "seed {seed}: request {id}: {tokens:?} vs {other:?}");
        }
        for (id, tokens) in &done {
            let other = done_ahead.get(id).or(aborted_ahead.get(id)).expect("every request ends in both modes");
            assert!(tokens.starts_with(other), "seed {seed}: request {id}: {tokens:?} vs {other:?}");
        }
    }
    assert!(planned_ahead > 3000, "the workloads plan few steps ahead: {planned_ahead}");
}

#[test]
fn a_step_is_planned_ahead_only_when_it_is_all_decodes() {
    let (mut s, mut kv, first) = first_step_planned(4, &[(1, vec![5; 20])]);
    let ahead = s.schedule_ahead(&first, &kv, &[]).expect("one request, sampling");
    assert_eq!((ahead.items[0].start, ahead.items[0].num_tokens), (20, 1));
    let plan = s.plan(&ahead, &mut kv).unwrap();
    assert_eq!((plan.input_ids.clone(), plan.positions.clone(), plan.seq_lens.clone()), (vec![0], vec![20], vec![21]));
    assert!(s.schedule_ahead(&ahead, &kv, &[]).is_none(), "the step ahead is not pending yet");
    assert!(s.commit_plan(&ahead, &mut kv).is_err(), "a step ahead is recorded after the pending one");
    s.commit_plan(&first, &mut kv).unwrap();
    s.update(&first, &[9]).unwrap();
    s.add(2, vec![6; 100], 0, None).unwrap();
    assert!(s.schedule_ahead(&ahead, &kv, &[]).is_none(), "a request waits, and a slot is free");
    s.commit_plan(&ahead, &mut kv).unwrap();
    s.update(&ahead, &[8]).unwrap();
    assert_eq!(s.request(1).unwrap().tokens[20..], [9, 8]);
    s.check(&kv).unwrap();
    let both = s.schedule(&mut kv);
    s.plan(&both, &mut kv).unwrap();
    assert!(s.schedule_ahead(&both, &kv, &[]).is_none(), "request 2's prompt is not done: it samples nothing");
}

#[test]
fn a_request_skipped_ahead_is_left_out() {
    let (mut s, kv, first) = first_step_planned(4, &[(1, vec![5; 16]), (2, vec![6; 3])]);
    let ahead = s.schedule_ahead(&first, &kv, &[2]).unwrap();
    assert_eq!(ahead.items.iter().map(|it| it.request).collect::<Vec<_>>(), vec![1]);
    assert_eq!(ahead.new_blocks(), 1, "position 16 starts request 1's second block");
    assert!(s.schedule_ahead(&first, &kv, &[1, 2]).is_none(), "nothing left, and a step is already ahead");
}

#[test]
fn a_step_is_planned_ahead_while_requests_wait_for_a_slot() {
    let (mut s, kv, first) = first_step_planned(1, &[(1, vec![5; 4]), (2, vec![6; 4])]);
    assert_eq!(s.num_waiting(), 1);
    let ahead = s.schedule_ahead(&first, &kv, &[]).expect("request 2 cannot start: the only slot is taken");
    assert_eq!(ahead.items.iter().map(|it| it.request).collect::<Vec<_>>(), vec![1]);
}

/// A scheduler over 32 blocks with these requests added, its first step scheduled and planned.
fn first_step_planned(
    max_num_seqs: usize,
    requests: &[(u64, Vec<u32>)],
) -> (Scheduler, SequenceTable, SchedulerOutput) {
    let mut kv = SequenceTable::new(32, 0, false);
    let cfg = SchedulerConfig { max_num_seqs, max_num_batched_tokens: 64, ..Default::default() };
    let mut s = Scheduler::new(cfg).unwrap();
    for (id, prompt) in requests {
        s.add(*id, prompt.clone(), 0, None).unwrap();
    }
    let first = s.schedule(&mut kv);
    s.plan(&first, &mut kv).unwrap();
    (s, kv, first)
}

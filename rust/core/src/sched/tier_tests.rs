//! The two-tier cache under the scheduler: a simulated KV memory per tier in which every slot holds
//! a fingerprint of the tokens its KV depends on (the sequence's tokens up to that position). Steps
//! run the recorded copies (demotions, then promotions), then write the step's slots, then run the
//! prefetches, as a runner may; after every step each running sequence must read, through its block
//! table, exactly the fingerprints of its own tokens. So a block demoted, promoted, prefetched,
//! reused or evicted at the wrong time shows up as wrong KV, and the tier invariants are checked
//! after every step. A prefetch may run at any time after the demotions, beside the forward pass:
//! no block the step reads or writes is a prefetch's source or destination, which is checked too.

use std::collections::HashSet;

use super::tests::Rng;
use super::*;
use crate::kv::{blocks_for, SequenceTable, TierCopies, BLOCK_TOKENS};
use crate::step::StepPlan;

type Slots = Vec<[u64; BLOCK_TOKENS]>;

struct Memory {
    device: Slots,
    host: Slots,
}

fn fingerprint(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ t as u64).wrapping_mul(0x1000_0000_01b3))
}

/// One engine step over `kv` and `mem` as a runner does it: plan, copy, write, commit, update.
fn step(s: &mut Scheduler, kv: &mut SequenceTable, mem: &mut Memory) -> SchedulerOutput {
    let out = s.schedule(kv);
    let plan = s.plan(&out, kv).unwrap();
    // An engine skips an empty step (no plan, no copies run): it must record none.
    assert!(!out.items.is_empty() || plan.copies == TierCopies::default(), "copies in an empty step");
    for &[d, h] in &plan.copies.demote {
        mem.host[h as usize] = mem.device[d as usize];
    }
    for &[h, d] in &plan.copies.promote {
        mem.device[d as usize] = mem.host[h as usize];
    }
    check_prefetches_stay_clear(&plan);
    for (s_idx, it) in out.items.iter().enumerate() {
        let tokens = &s.request(it.request).unwrap().tokens;
        for t in plan.query_start_loc[s_idx] as usize..plan.query_start_loc[s_idx + 1] as usize {
            let (pos, slot) = (plan.positions[t] as usize, plan.slot_mapping[t] as usize);
            assert_eq!(plan.input_ids[t] as u32, tokens[pos]);
            mem.device[slot / BLOCK_TOKENS][slot % BLOCK_TOKENS] = fingerprint(&tokens[..=pos]);
        }
    }
    for &[h, d] in &plan.copies.prefetch {
        mem.device[d as usize] = mem.host[h as usize];
    }
    s.commit_plan(&out, kv).unwrap();
    s.update(&out, &vec![7; out.num_sample()]).unwrap();
    s.check(kv).unwrap();
    check_memory(s, kv, mem);
    out
}

/// No prefetch touches a block the step's forward pass reads or writes, nor a block another copy of
/// the step writes: the runner may run them beside the forward pass.
fn check_prefetches_stay_clear(plan: &StepPlan) {
    // Rows are padded with block 0: only each sequence's own blocks count.
    let rows = plan.block_tables.chunks(plan.max_blocks.max(1));
    let step_blocks: HashSet<i32> =
        rows.zip(&plan.seq_lens).flat_map(|(row, &len)| row[..blocks_for(len as usize)].to_vec()).collect();
    let promoted: HashSet<u32> = plan.copies.promote.iter().map(|p| p[1]).collect();
    // (A host block demoted to in this step may be prefetched from: its demotion runs first.)
    for &[_, d] in &plan.copies.prefetch {
        assert!(!step_blocks.contains(&(d as i32)), "prefetch into block {d}, which the step uses");
        assert!(!promoted.contains(&d), "prefetch into block {d}, which a promotion writes");
    }
}

/// Every running request reads its own tokens' KV through its block table.
fn check_memory(s: &Scheduler, kv: &SequenceTable, mem: &Memory) {
    for id in s.running_ids() {
        let r = s.request(id).unwrap();
        let seq = kv.get(r.seq.unwrap()).unwrap();
        for pos in 0..seq.len {
            let block = seq.block_table[pos / BLOCK_TOKENS] as usize;
            let want = fingerprint(&r.tokens[..=pos]);
            assert_eq!(mem.device[block][pos % BLOCK_TOKENS], want, "request {id} position {pos}: wrong KV");
        }
    }
}

fn table(device: usize, host: usize) -> (SequenceTable, Memory) {
    let kv = SequenceTable::with_host_tier(device, host, 0, true);
    (kv, Memory { device: vec![[0; BLOCK_TOKENS]; device], host: vec![[u64::MAX; BLOCK_TOKENS]; host] })
}

#[test]
fn a_demoted_prefix_is_promoted_instead_of_recomputed() {
    let (mut kv, mut mem) = table(6, 8);
    let mut s =
        Scheduler::new(SchedulerConfig { max_num_seqs: 1, max_num_batched_tokens: 128, ..Default::default() }).unwrap();
    let a: Vec<u32> = (0..49).collect(); // 3 full blocks + 1 token
    s.add(0, a.clone(), 0, None).unwrap();
    step(&mut s, &mut kv, &mut mem);
    s.finish(0, &mut kv);
    // Another prompt needs every device block: A's idle blocks are demoted, not dropped.
    s.add(1, (100..196).collect(), 0, None).unwrap();
    step(&mut s, &mut kv, &mut mem);
    s.finish(1, &mut kv);
    let stats = kv.cache_stats();
    assert_eq!(stats.demotions, 3, "{stats:?}");
    // A again: its three blocks come back from the host tier; only the last token is computed.
    s.add(2, a, 0, None).unwrap();
    let out = step(&mut s, &mut kv, &mut mem);
    assert_eq!(out.items[0].num_tokens, 1);
    let stats = kv.cache_stats();
    assert_eq!((stats.promotions, stats.host_hit_tokens), (3, 48), "{stats:?}");
    s.finish(2, &mut kv);
    kv.check().unwrap();
}

/// Adds a request and steps until its prompt is computed, then finishes it.
fn run_prompt(s: &mut Scheduler, kv: &mut SequenceTable, mem: &mut Memory, id: u64, prompt: Vec<u32>) {
    let len = prompt.len();
    s.add(id, prompt, 0, None).unwrap();
    while s.request(id).unwrap().num_computed < len {
        step(s, kv, mem);
    }
    assert!(s.finish(id, kv));
}

/// Two requests at a time over 8 device and 8 host blocks, after prompt A (3 full blocks and a
/// token, returned) ran and a prompt filling the device pushed its 3 blocks to the host tier.
fn with_a_demoted(budget: usize, host_prefetch: bool) -> (Scheduler, SequenceTable, Memory, Vec<u32>) {
    let (mut kv, mut mem) = table(8, 8);
    let cfg = SchedulerConfig { max_num_seqs: 2, max_num_batched_tokens: budget, host_prefetch, ..Default::default() };
    let mut s = Scheduler::new(cfg).unwrap();
    let a: Vec<u32> = (0..49).collect();
    run_prompt(&mut s, &mut kv, &mut mem, 0, a.clone());
    run_prompt(&mut s, &mut kv, &mut mem, 1, (100..228).collect());
    assert_eq!(kv.cache_stats().demotions, 3);
    (s, kv, mem, a)
}

#[test]
fn a_waiting_requests_host_prefix_is_prefetched_while_another_prompt_runs() {
    for host_prefetch in [true, false] {
        let (mut s, mut kv, mut mem, a) = with_a_demoted(32, host_prefetch);
        // C takes the whole token budget; A's prompt again waits behind it.
        s.add(2, (500..540).collect(), 0, None).unwrap();
        s.add(3, a.clone(), 0, None).unwrap();
        let out = step(&mut s, &mut kv, &mut mem);
        assert_eq!(out.items.len(), 1, "only C runs");
        let stats = kv.cache_stats();
        let prefetched = if host_prefetch { 3 } else { 0 };
        assert_eq!((stats.prefetched_blocks, stats.promotions), (prefetched, prefetched), "{stats:?}");
        // Next step A starts on its three blocks: on the device already, or promoted now.
        let promotions_before = stats.promotions;
        let out = step(&mut s, &mut kv, &mut mem);
        let a_item = out.items.iter().find(|it| it.request == 3).expect("A starts");
        assert_eq!(a_item.num_tokens, 1, "only A's last token is computed");
        let stats = kv.cache_stats();
        assert_eq!(stats.promotions - promotions_before, 3 - prefetched, "{stats:?}");
        assert_eq!(stats.host_hit_tokens, 48 - 16 * prefetched, "{stats:?}");
        for id in [2, 3] {
            s.finish(id, &mut kv);
        }
        s.check(&kv).unwrap();
    }
}

#[test]
fn a_request_whose_prefix_is_in_the_host_tier_starts_a_step_later_on_prefetched_blocks() {
    for host_prefetch in [true, false] {
        let (mut s, mut kv, mut mem, a) = with_a_demoted(64, host_prefetch);
        s.add(2, (500..520).collect(), 0, None).unwrap();
        step(&mut s, &mut kv, &mut mem); // D's prompt; D decodes from now on
        s.add(3, a.clone(), 0, None).unwrap();
        let out = step(&mut s, &mut kv, &mut mem);
        let started = |out: &SchedulerOutput| out.items.iter().any(|it| it.request == 3);
        let stats = kv.cache_stats();
        if host_prefetch {
            assert!(!started(&out), "A waits a step while its prefix is prefetched");
            assert_eq!((stats.prefetched_blocks, stats.host_hit_tokens), (3, 0), "{stats:?}");
            let out = step(&mut s, &mut kv, &mut mem);
            assert!(started(&out), "A starts the step after");
        } else {
            assert!(started(&out), "A starts at once, promoting its prefix");
            assert_eq!((stats.prefetched_blocks, stats.host_hit_tokens), (0, 48), "{stats:?}");
        }
        assert_eq!(s.request(3).unwrap().num_computed, 49, "only A's last token was computed");
        assert_eq!(kv.cache_stats().promotions, 3);
        for id in [2, 3] {
            s.finish(id, &mut kv);
        }
        s.check(&kv).unwrap();
    }
}

#[test]
fn without_host_room_evicted_blocks_are_dropped() {
    let (mut kv, mut mem) = table(6, 1);
    let mut s =
        Scheduler::new(SchedulerConfig { max_num_seqs: 1, max_num_batched_tokens: 64, ..Default::default() }).unwrap();
    s.add(0, (0..49).collect(), 0, None).unwrap();
    step(&mut s, &mut kv, &mut mem);
    s.finish(0, &mut kv);
    s.add(1, (100..180).collect(), 0, None).unwrap();
    step(&mut s, &mut kv, &mut mem);
    let stats = kv.cache_stats();
    assert_eq!((stats.demotions, stats.host_cached_blocks), (1, 1), "one host block, pending: {stats:?}");
    s.finish(1, &mut kv);
    kv.check().unwrap();
}

/// Returns how many blocks were promoted and how many of them prefetched.
fn random_workload(seed: u64) -> (u64, u64) {
    let mut rng = Rng(seed);
    let device = 4 + rng.below(20) as usize;
    let host = rng.below(2 * device as u64 + 1) as usize;
    let (mut kv, mut mem) = table(device, host);
    let seqs = 1 + rng.below(4) as usize;
    let cfg = SchedulerConfig {
        max_num_seqs: seqs,
        max_num_batched_tokens: seqs + rng.below(40) as usize,
        host_prefetch: rng.below(4) != 0,
        ..Default::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let mut next_id = 0;
    let limit = device * BLOCK_TOKENS / 2;
    for _ in 0..300 {
        match rng.below(10) {
            0..=2 => {
                let len = 1 + rng.below(limit as u64 - 1) as usize;
                let group = rng.below(4) as u32; // a few shared prefixes, so blocks are cached and reused
                let p: Vec<u32> = (0..len as u32).map(|i| if i < 40 { group * 1000 + i } else { i }).collect();
                s.add(next_id, p, 0, None).unwrap();
                next_id += 1;
            }
            3 => {
                s.abort(rng.below(next_id.max(1)), &mut kv);
            }
            _ => {
                step(&mut s, &mut kv, &mut mem);
                for id in s.running_ids() {
                    if s.request(id).unwrap().tokens.len() >= limit || rng.below(8) == 0 {
                        s.finish(id, &mut kv);
                    }
                }
            }
        }
    }
    drain(&mut s, &mut kv, &mut mem, seed);
    s.check(&kv).unwrap();
    let stats = kv.cache_stats();
    kv.reset_prefix_cache();
    assert_eq!(kv.num_free_blocks(), device, "seed {seed}: device blocks leaked");
    assert_eq!(kv.cache_stats().host_free_blocks, host, "seed {seed}: host blocks leaked");
    (stats.promotions, stats.prefetched_blocks)
}

/// Runs every request left to the end of its prompt, then finishes it: each must get there (no request
/// is put off or preempted forever) within a bound on the steps, four times what computing every
/// token left at the step budget's pace takes.
fn drain(s: &mut Scheduler, kv: &mut SequenceTable, mem: &mut Memory, seed: u64) {
    let ids: Vec<u64> = s.running_ids().into_iter().chain(s.waiting_ids()).collect();
    let tokens: usize = ids.iter().map(|&id| s.request(id).unwrap().tokens.len()).sum();
    let bound = 4 * (tokens.div_ceil(s.config().max_num_batched_tokens) + ids.len()) + 64;
    for _ in 0..bound {
        if s.num_running() + s.num_waiting() == 0 {
            return;
        }
        step(s, kv, mem);
        for id in s.running_ids() {
            if s.request(id).unwrap().remaining() <= 1 {
                s.finish(id, kv);
            }
        }
    }
    panic!("seed {seed}: {} requests still unfinished after {bound} steps", s.num_running() + s.num_waiting());
}

#[test]
fn random_workloads_over_two_tiers_read_their_own_kv_and_leak_nothing() {
    let (promoted, prefetched) = (0..300).map(random_workload).fold((0, 0), |(p, f), (dp, df)| (p + dp, f + df));
    assert!(promoted > 300, "the workloads must exercise promotion, got {promoted} blocks");
    assert!(prefetched > 100, "the workloads must exercise prefetching, got {prefetched} blocks");
}

//! The two-tier cache under the scheduler: a simulated KV memory per tier in which every slot holds
//! a fingerprint of the tokens its KV depends on (the sequence's tokens up to that position). Steps
//! run the recorded copies (demotions, then promotions), then write the step's slots, as a runner
//! must; after every step each running sequence must read, through its block table, exactly the
//! fingerprints of its own tokens. So a block demoted, promoted, reused or evicted at the wrong time
//! shows up as wrong KV, and the tier invariants are checked after every step.

use super::tests::Rng;
use super::*;
use crate::kv::{SequenceTable, BLOCK_TOKENS};

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
    for &[d, h] in &plan.copies.demote {
        mem.host[h as usize] = mem.device[d as usize];
    }
    for &[h, d] in &plan.copies.promote {
        mem.device[d as usize] = mem.host[h as usize];
    }
    for (s_idx, it) in out.items.iter().enumerate() {
        let tokens = &s.request(it.request).unwrap().tokens;
        for t in plan.query_start_loc[s_idx] as usize..plan.query_start_loc[s_idx + 1] as usize {
            let (pos, slot) = (plan.positions[t] as usize, plan.slot_mapping[t] as usize);
            assert_eq!(plan.input_ids[t] as u32, tokens[pos]);
            mem.device[slot / BLOCK_TOKENS][slot % BLOCK_TOKENS] = fingerprint(&tokens[..=pos]);
        }
    }
    s.commit_plan(&out, kv).unwrap();
    s.update(&out, &vec![7; out.num_sample()]).unwrap();
    s.check(kv).unwrap();
    check_memory(s, kv, mem);
    out
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

/// Returns how many blocks were promoted.
fn random_workload(seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let device = 4 + rng.below(20) as usize;
    let host = rng.below(2 * device as u64 + 1) as usize;
    let (mut kv, mut mem) = table(device, host);
    let seqs = 1 + rng.below(4) as usize;
    let cfg = SchedulerConfig {
        max_num_seqs: seqs,
        max_num_batched_tokens: seqs + rng.below(40) as usize,
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
    for id in s.running_ids().into_iter().chain(s.waiting_ids()) {
        assert!(s.finish(id, &mut kv));
    }
    s.check(&kv).unwrap();
    let promotions = kv.cache_stats().promotions;
    kv.reset_prefix_cache();
    assert_eq!(kv.num_free_blocks(), device, "seed {seed}: device blocks leaked");
    assert_eq!(kv.cache_stats().host_free_blocks, host, "seed {seed}: host blocks leaked");
    promotions
}

#[test]
fn random_workloads_over_two_tiers_read_their_own_kv_and_leak_nothing() {
    let promoted: u64 = (0..300).map(random_workload).sum();
    assert!(promoted > 300, "the workloads must exercise promotion, got {promoted} blocks");
}

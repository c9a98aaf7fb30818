//! Speculative decoding in the scheduler, over a model-free [`SequenceTable`]: what gets drafted,
//! what a step records of its drafts, and random workloads that must keep the invariants and leave
//! every block free.

use super::*;
use crate::kv::{SequenceTable, BLOCK_TOKENS};
use crate::spec::NgramConfig;

fn speculating(max_num_seqs: usize, budget: usize, num_tokens: usize) -> Scheduler {
    let speculation = Some(NgramConfig { num_tokens, min_n: 1, max_n: 3, adaptive: false });
    let config = SchedulerConfig { max_num_seqs, max_num_batched_tokens: budget, speculation, ..Default::default() };
    Scheduler::new(config).unwrap()
}

/// `pattern` repeated to `len` tokens: every suffix has occurred before, so decodes get drafts.
fn repeating(pattern: &[u32], len: usize) -> Vec<u32> {
    pattern.iter().copied().cycle().take(len).collect()
}

/// Runs a step on the ledger; `pick(item, drafts, last)` gives each sampling item's kept drafts and
/// the token drawn after them (`last`: the token the item decodes).
fn step(
    s: &mut Scheduler,
    kv: &mut SequenceTable,
    mut pick: impl FnMut(&ScheduledItem, &[u32], u32) -> (usize, u32),
) -> SchedulerOutput {
    let out = s.schedule(kv);
    s.advance_ledger(&out, kv).unwrap();
    s.check(kv).unwrap();
    let drafts: Vec<Vec<u32>> = s.drafts_of(&out).into_iter().map(<[u32]>::to_vec).collect();
    let (mut sampled, mut accepted) = (vec![], vec![]);
    for (it, drafts) in out.items.iter().filter(|it| it.sample).zip(&drafts) {
        assert_eq!(drafts.len(), it.drafts as usize);
        let last = s.request(it.request).unwrap().tokens[it.start + it.num_tokens - 1 - drafts.len()];
        let (kept, next) = pick(it, drafts, last);
        sampled.extend_from_slice(&drafts[..kept]);
        sampled.push(next);
        accepted.push(kept);
    }
    s.update_drafted(&out, &sampled, &accepted, kv).unwrap();
    s.check(kv).unwrap();
    out
}

#[test]
fn a_repeating_request_decodes_its_drafts_and_keeps_those_accepted() {
    let mut kv = SequenceTable::new(64, 0, true);
    let mut s = speculating(2, 64, 4);
    s.add(1, repeating(&[5, 6, 7], 30), 0, None).unwrap();
    s.allow_drafts(1, 100).unwrap();
    step(&mut s, &mut kv, |_, _, _| (0, 5)); // the prompt
    let out = step(&mut s, &mut kv, |_, drafts, _| {
        assert_eq!(drafts, [6, 7, 5, 6], "what followed the last 5, 6, 7, 5");
        (4, 7)
    });
    assert_eq!((out.items[0].num_tokens, out.num_draft_tokens), (5, 4));
    let r = s.request(1).unwrap();
    assert_eq!(r.tokens[30..], [5, 6, 7, 5, 6, 7]);
    assert_eq!(r.num_computed, 35, "the token and the four drafts hold KV, the last draw does not");
    assert_eq!(kv.sequence_len(r.seq.unwrap()).unwrap(), 35);
    assert_eq!(s.stats().draft_tokens, 4);
}

#[test]
fn rejected_drafts_give_back_the_blocks_they_took() {
    let mut kv = SequenceTable::new(16, 0, false);
    let mut s = speculating(1, 64, 8);
    s.add(1, repeating(&[1, 2], BLOCK_TOKENS - 2), 0, None).unwrap();
    s.allow_drafts(1, 100).unwrap();
    step(&mut s, &mut kv, |_, _, _| (0, 1));
    let free = kv.num_free_blocks();
    let out = step(&mut s, &mut kv, |it, drafts, _| {
        assert_eq!(it.drafts, 8);
        assert_eq!(drafts, [2, 1, 2, 1, 2, 1, 2, 1]);
        (1, 9)
    });
    assert_eq!(out.new_blocks(), 1, "the drafts crossed into a second block");
    assert_eq!(kv.num_free_blocks(), free, "two tokens kept fill the first block exactly");
    assert_eq!(s.request(1).unwrap().num_computed, BLOCK_TOKENS);
}

#[test]
fn drafts_take_only_what_the_rest_of_the_step_leaves_and_stop_at_the_limit() {
    let mut kv = SequenceTable::new(64, 0, false);
    let mut s = speculating(4, 8, 4);
    for (id, limit) in [(0, 100), (1, 100), (2, 3)] {
        s.add(id, vec![3, 3], 0, None).unwrap();
        s.allow_drafts(id, limit).unwrap();
    }
    let keep_none = |_: &ScheduledItem, _: &[u32], _: u32| (0, 3);
    step(&mut s, &mut kv, keep_none);
    s.add(3, repeating(&[3], 10), 0, None).unwrap();
    s.allow_drafts(3, 100).unwrap();
    let work = |out: &SchedulerOutput| out.items.iter().map(|it| (it.request, it.num_tokens)).collect::<Vec<_>>();
    let out = step(&mut s, &mut kv, keep_none);
    assert_eq!(work(&out), [(0, 1), (1, 1), (2, 1), (3, 5)], "the new prompt's chunk before any draft");
    let out = step(&mut s, &mut kv, keep_none);
    assert_eq!(work(&out), [(0, 1), (1, 1), (2, 1), (3, 5)]);
    let out = step(&mut s, &mut kv, keep_none);
    assert_eq!(work(&out), [(0, 5), (1, 1), (2, 1), (3, 1)], "four spare tokens, all to the first decode");
    s.finish(0, &mut kv);
    let out = step(&mut s, &mut kv, keep_none);
    assert_eq!(work(&out), [(1, 5), (2, 1), (3, 2)], "request 2 is past its limit: no drafts");
}

#[test]
fn a_kept_token_that_is_not_its_draft_is_refused_and_changes_nothing() {
    let mut kv = SequenceTable::new(64, 0, true);
    let mut s = speculating(1, 64, 3);
    s.add(1, repeating(&[8, 9], 12), 0, None).unwrap();
    s.allow_drafts(1, 100).unwrap();
    step(&mut s, &mut kv, |_, _, _| (0, 8));
    let out = s.schedule(&mut kv);
    s.advance_ledger(&out, &mut kv).unwrap();
    let drafts = s.drafts_of(&out)[0].to_vec();
    assert_eq!(drafts, [9, 8, 9]);
    assert!(s.update(&out, &[1]).is_err(), "a drafted step needs update_drafted");
    assert!(s.update_drafted(&out, &[9, 9, 1], &[2], &mut kv).is_err(), "9, 9 is not the drafts' 9, 8");
    assert!(s.update_drafted(&out, &[9, 8, 9, 8, 1], &[4], &mut kv).is_err(), "four kept of three drafted");
    assert!(s.update_drafted(&out, &[9, 8], &[2], &mut kv).is_err(), "the draw after them is missing");
    s.update_drafted(&out, &[9, 8, 1], &[2], &mut kv).unwrap();
    assert_eq!(s.request(1).unwrap().tokens[12..], [8, 9, 8, 1]);
    s.check(&kv).unwrap();
}

#[test]
fn an_adaptive_proposer_drafts_more_for_kept_drafts_and_stops_for_rejected_ones() {
    let speculation = Some(NgramConfig { num_tokens: 6, min_n: 1, max_n: 3, adaptive: true });
    let config = SchedulerConfig { max_num_seqs: 1, max_num_batched_tokens: 64, speculation, ..Default::default() };
    let mut s = Scheduler::new(config).unwrap();
    let mut kv = SequenceTable::new(64, 0, false);
    s.add(1, repeating(&[1, 2, 3], 9), 0, None).unwrap();
    s.allow_drafts(1, 1000).unwrap();
    step(&mut s, &mut kv, |_, _, _| (0, 1));
    // The pattern continues: every draft is kept.
    let follow =
        |_: &ScheduledItem, drafts: &[u32], last: u32| (drafts.len(), drafts.last().copied().unwrap_or(last) % 3 + 1);
    let mut drafted = vec![];
    for _ in 0..8 {
        drafted.push(step(&mut s, &mut kv, follow).num_draft_tokens);
    }
    assert_eq!(drafted[0], 1, "one draft on the prior alone");
    assert_eq!(*drafted.last().unwrap(), 6, "kept drafts earn the most: {drafted:?}");
    // The pattern breaks: every draft is rejected, every draw is new.
    let mut drafted = vec![];
    for fresh in 100..112 {
        drafted.push(step(&mut s, &mut kv, |_, _, _| (0, fresh)).num_draft_tokens);
    }
    assert_eq!(*drafted.last().unwrap(), 0, "rejected drafts stop: {drafted:?}");
    // The pattern again: the shadow drafts it would have kept bring the drafts back.
    let mut drafted = vec![];
    for _ in 0..12 {
        drafted.push(step(&mut s, &mut kv, follow).num_draft_tokens);
    }
    assert!(*drafted.last().unwrap() > 0, "drafts resume: {drafted:?}");
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn random_drafted_workloads_keep_the_invariants_and_free_every_block() {
    let mut state = 0x2545_F491_4F6C_DD1D ^ std::process::id() as u64;
    for round in 0..40 {
        let blocks = 12 + (xorshift(&mut state) % 40) as usize;
        let mut kv = SequenceTable::new(blocks, 0, round % 2 == 0);
        let mut s = speculating(1 + (xorshift(&mut state) % 4) as usize, 16 + (xorshift(&mut state) % 48) as usize, 6);
        let mut limits = std::collections::HashMap::new();
        for id in 0..12u64 {
            let pattern: Vec<u32> =
                (0..1 + xorshift(&mut state) % 4).map(|_| (xorshift(&mut state) % 5) as u32).collect();
            let len = 1 + (xorshift(&mut state) % 40) as usize;
            let limit = (len + 1 + (xorshift(&mut state) % 30) as usize).min(blocks * BLOCK_TOKENS);
            s.add(id, repeating(&pattern, len), 0, None).unwrap();
            s.allow_drafts(id, limit).unwrap();
            limits.insert(id, limit);
        }
        while s.num_running() + s.num_waiting() > 0 {
            let out = step(&mut s, &mut kv, |_, drafts, _| {
                let kept = (xorshift(&mut state) as usize) % (drafts.len() + 1);
                (kept, (xorshift(&mut state) % 5) as u32)
            });
            for it in out.items.iter().filter(|it| it.sample) {
                let Some(r) = s.request(it.request) else { continue };
                let limit = limits[&it.request];
                assert!(it.start + it.num_tokens <= limit, "drafts past the limit");
                if r.tokens.len() >= limit || xorshift(&mut state).is_multiple_of(8) {
                    s.finish(it.request, &mut kv);
                }
            }
            s.check(&kv).unwrap();
        }
        assert_eq!(kv.num_available_blocks(), blocks, "every block is free or idle in the cache");
    }
}

//! `SequenceTable::fork`: a fork shares its parent's cached blocks, holds its own copy of every other
//! block, and grows apart from it; random traffic of adds, appends, forks and frees keeps the table's
//! and the cache's invariants and leaks no block.

use super::{SequenceTable, BLOCK_TOKENS};

/// A seed per run (the test names it when it fails).
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(0u64)
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn grow(table: &mut SequenceTable, seq: u64, tokens: &[u32]) {
    table.reserve(&[(seq, tokens.len())]).unwrap();
    table.append(seq, tokens).unwrap();
}

#[test]
fn a_fork_shares_cached_blocks_and_copies_the_rest() {
    let mut table = SequenceTable::new(16, 0, true);
    let parent = table.add_sequence_cached(&[], None).0;
    let tokens: Vec<u32> = (0..2 * BLOCK_TOKENS as u32 + 5).collect();
    grow(&mut table, parent, &tokens);
    let (child, copies) = table.fork(parent).unwrap();
    let (p, c) = (table.get(parent).unwrap().block_table.clone(), table.get(child).unwrap().block_table.clone());
    assert_eq!(table.sequence_len(child).unwrap(), tokens.len());
    assert_eq!(&c[..2], &p[..2], "the two full blocks are shared");
    assert_eq!(copies, vec![(p[2], c[2])], "the partial block is copied into a block of its own");
    assert_ne!(p[2], c[2]);
    table.check().unwrap();
    // They grow apart: each fills its own third block, the parent's is cached, the child's too.
    grow(&mut table, parent, &[7; BLOCK_TOKENS - 5]);
    grow(&mut table, child, &[9; BLOCK_TOKENS - 5]);
    table.check().unwrap();
    table.free_sequence(parent).unwrap();
    table.free_sequence(child).unwrap();
    assert_eq!(table.num_available_blocks(), table.num_blocks());
    assert!(table.fork(parent).is_err(), "a freed sequence cannot be forked");
}

#[test]
fn a_fork_without_room_changes_nothing() {
    let mut table = SequenceTable::new(3, 0, true);
    let parent = table.add_sequence_cached(&[], None).0;
    grow(&mut table, parent, &[1; 2 * BLOCK_TOKENS + 1]);
    let before = table.cache_stats();
    assert!(table.fork(parent).is_err(), "the partial block needs a fourth block");
    assert_eq!(table.cache_stats(), before);
    assert_eq!(table.num_sequences(), 1);
    table.check().unwrap();
}

#[test]
fn random_forks_keep_every_invariant_and_leak_nothing() {
    let seed = fresh_seed();
    for caching in [true, false] {
        let mut rng = Rng(seed);
        let mut table = SequenceTable::new(40, 0, caching);
        let mut live: Vec<u64> = Vec::new();
        for step in 0..3000 {
            match rng.below(4) {
                0 if live.len() < 6 => live.push(table.add_sequence_cached(&[], None).0),
                1 if !live.is_empty() => {
                    let seq = live[rng.below(live.len() as u64) as usize];
                    let n = 1 + rng.below(20) as usize;
                    let tokens: Vec<u32> = (0..n).map(|_| rng.below(3) as u32).collect();
                    if table.new_blocks_for(seq, n).unwrap() <= table.num_available_blocks() {
                        grow(&mut table, seq, &tokens);
                    }
                }
                2 if !live.is_empty() && live.len() < 8 => {
                    let parent = live[rng.below(live.len() as u64) as usize];
                    if let Ok((child, _)) = table.fork(parent) {
                        let len = table.sequence_len(parent).unwrap();
                        assert_eq!(table.sequence_len(child).unwrap(), len, "seed {seed}, step {step}");
                        live.push(child);
                    }
                }
                _ if !live.is_empty() => {
                    let seq = live.swap_remove(rng.below(live.len() as u64) as usize);
                    table.free_sequence(seq).unwrap();
                }
                _ => {}
            }
            table.check().unwrap_or_else(|e| panic!("seed {seed}, step {step}: {e}"));
        }
        for seq in live.drain(..) {
            table.free_sequence(seq).unwrap();
        }
        assert_eq!(table.num_available_blocks(), table.num_blocks(), "seed {seed}: a block leaked");
    }
}

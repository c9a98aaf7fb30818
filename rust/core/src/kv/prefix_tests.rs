use super::*;

const B: usize = BLOCK_TOKENS;

fn prompt(blocks: usize, seed: u32) -> Vec<u32> {
    (0..(blocks * B) as u32).map(|i| i.wrapping_mul(2654435761).wrapping_add(seed) % 1000).collect()
}

/// Allocates blocks for `tokens`' full blocks after the cached prefix, caches them, and returns the
/// whole chain the caller now holds.
fn run(cache: &mut PrefixCache, tokens: &[u32], salt: Option<&Arc<str>>) -> Vec<u32> {
    let m = cache.acquire(tokens, salt.map(|s| &**s), usize::MAX);
    let mut blocks = m.block_ids.clone();
    while blocks.len() < tokens.len() / B {
        blocks.push(cache.allocate().expect("a block"));
    }
    let cached = cache.insert_chain(tokens, &mut blocks, salt).unwrap();
    assert_eq!(cached, blocks.len());
    cache.check().unwrap();
    blocks
}

fn release_all(cache: &mut PrefixCache, blocks: &[u32]) {
    for &b in blocks {
        cache.release(b).unwrap();
    }
    cache.check().unwrap();
}

#[test]
fn a_cached_prefix_is_found_again_and_shared() {
    let mut cache = PrefixCache::new(8, 100);
    let p = prompt(3, 1);
    let first = run(&mut cache, &p, None);
    release_all(&mut cache, &first);
    assert_eq!((cache.num_cached(), cache.num_idle(), cache.num_free()), (3, 3, 5));
    let mut longer = p.clone();
    longer.extend(prompt(1, 9));
    let m = cache.acquire(&longer, None, usize::MAX);
    assert_eq!((m.cached_tokens, m.block_ids.clone(), m.idle_blocks), (3 * B, first.clone(), 3));
    assert_eq!(cache.users(first[0]), 1);
    assert_eq!(cache.num_idle(), 0);
    let capped = cache.lookup(&longer, None, 2);
    assert_eq!(capped.block_ids, first[..2]);
    let s = cache.stats();
    assert_eq!((s.queries, s.hits, s.hit_tokens, s.queried_tokens), (2, 1, 48, 112));
    assert_eq!((s.bytes_in_use, s.capacity_bytes), (300, 800));
}

#[test]
fn salts_keep_tenants_apart() {
    let mut cache = PrefixCache::new(8, 0);
    let p = prompt(2, 3);
    let a: Arc<str> = "tenant-a".into();
    let blocks = run(&mut cache, &p, Some(&a));
    assert_eq!(cache.lookup(&p, None, usize::MAX).cached_tokens, 0);
    assert_eq!(cache.lookup(&p, Some("tenant-b"), usize::MAX).cached_tokens, 0);
    assert_eq!(cache.lookup(&p, Some("tenant-a"), usize::MAX).block_ids, blocks);
}

#[test]
fn equal_blocks_computed_twice_end_up_as_one_copy() {
    let mut cache = PrefixCache::new(8, 0);
    let p = prompt(2, 5);
    let mut a = vec![cache.allocate().unwrap(), cache.allocate().unwrap()];
    let mut b = vec![cache.allocate().unwrap(), cache.allocate().unwrap()];
    cache.insert_chain(&p, &mut a, None).unwrap();
    let before = b.clone();
    assert_eq!(cache.insert_chain(&p, &mut b, None).unwrap(), 2);
    assert_eq!(a, b);
    assert_eq!(cache.num_free(), 6);
    assert!(before.iter().all(|&x| cache.users(x) == 0 && !cache.is_cached(x)));
    assert_eq!(cache.users(a[0]), 2);
    cache.check().unwrap();
}

#[test]
fn eviction_takes_least_recently_used_leaves_first() {
    let mut cache = PrefixCache::new(6, 0);
    let old = run(&mut cache, &prompt(2, 1), None);
    let new = run(&mut cache, &prompt(2, 2), None);
    release_all(&mut cache, &old);
    release_all(&mut cache, &new);
    // The leaf of the older chain goes first, then its parent (now a leaf), then the newer chain.
    assert_eq!(cache.evict(3), vec![old[1], old[0], new[1]]);
    assert_eq!(cache.stats().evictions, 3);
    assert_eq!(cache.reset(), 1);
    assert_eq!((cache.num_cached(), cache.num_free()), (0, 6));
}

#[test]
fn a_block_in_use_is_never_evicted_or_reused() {
    let mut cache = PrefixCache::new(4, 0);
    let held = run(&mut cache, &prompt(2, 1), None);
    let idle = run(&mut cache, &prompt(2, 2), None);
    release_all(&mut cache, &idle);
    let mut got = vec![cache.allocate().unwrap(), cache.allocate().unwrap()];
    got.sort();
    let mut want = idle.clone();
    want.sort();
    assert_eq!(got, want);
    assert_eq!(cache.allocate(), None);
    assert_eq!(cache.reset(), 0);
    assert!(held.iter().all(|&b| cache.is_cached(b) && cache.users(b) == 1));
    cache.check().unwrap();
}

#[test]
fn a_parent_with_a_cached_child_waits_for_it() {
    let mut cache = PrefixCache::new(4, 0);
    let p = prompt(2, 7);
    let chain = run(&mut cache, &p, None);
    // The parent goes idle first (it is the least recently used), but the child hangs below it, so
    // the child is evicted first.
    cache.release(chain[0]).unwrap();
    cache.release(chain[1]).unwrap();
    assert_eq!(cache.evict(1), vec![chain[1]]);
    assert_eq!(cache.evict(1), vec![chain[0]]);
}

#[test]
fn bad_calls_are_refused_without_damage() {
    let mut cache = PrefixCache::new(4, 0);
    let b = cache.allocate().unwrap();
    assert!(cache.release(3).is_err());
    assert!(cache.insert(None, &[1, 2, 3], None, b).is_err());
    assert!(cache.insert(None, &prompt(1, 0), None, 2).is_err());
    cache.insert(None, &prompt(1, 0), None, b).unwrap();
    cache.release(b).unwrap();
    assert!(cache.release(b).is_err(), "the trie's own reference is not the caller's to drop");
    // A parent that was evicted cannot take children.
    let key = cache.lookup(&prompt(1, 0), None, 1).last_key;
    cache.reset();
    let c = cache.allocate().unwrap();
    assert_eq!(cache.insert(key, &prompt(1, 1), None, c).unwrap(), Inserted::Rejected);
    cache.check().unwrap();
}

#[test]
fn random_traffic_keeps_every_invariant_and_leaks_nothing() {
    let mut cache = PrefixCache::new(24, 0);
    let mut state = 12345u64;
    let mut next = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let mut live: Vec<Vec<u32>> = Vec::new();
    for _ in 0..2000 {
        if live.len() < 3 && next(3) > 0 {
            // Prompts share their first blocks often: a few "system prompts", then a random tail.
            let mut p = prompt(next(3) as usize, next(3) as u32);
            p.extend(prompt(next(4) as usize, next(1000) as u32));
            let need = (p.len() / B).saturating_sub(cache.lookup(&p, None, usize::MAX).block_ids.len());
            if need <= cache.num_available() {
                live.push(run(&mut cache, &p, None));
            }
        } else if !live.is_empty() {
            let blocks = live.swap_remove(next(live.len() as u64) as usize);
            release_all(&mut cache, &blocks);
        }
    }
    for blocks in live.drain(..) {
        release_all(&mut cache, &blocks);
    }
    assert_eq!(cache.num_available(), cache.capacity());
    cache.reset();
    assert_eq!(cache.num_free(), cache.capacity());
}

/// A parent becomes an idle leaf with a tick between the other leaves' (it was released after one
/// chain and before another): it is still evicted in exact least-recently-used order.
#[test]
fn a_parent_freed_by_eviction_takes_its_place_in_the_order() {
    let mut cache = PrefixCache::new(8, 0);
    let a = run(&mut cache, &prompt(2, 1), None);
    let b = run(&mut cache, &prompt(1, 2), None);
    let c = run(&mut cache, &prompt(1, 3), None);
    release_all(&mut cache, &[a[1], b[0], a[0], c[0]]);
    assert_eq!(cache.evict(1), [a[1]]);
    cache.check().unwrap();
    assert_eq!(cache.evict(3), [b[0], a[0], c[0]]);
    cache.check().unwrap();
    assert_eq!(cache.num_cached(), 0);
}

/// SplitMix64: the property test below replays from the printed seed.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A cache's contents listed by `cached_blocks` and restored one by one into a fresh cache (as a cache
/// file is loaded) give a cache that passes `check` and answers every lookup as the original does;
/// into a smaller cache, every restored block's chain is complete and nothing is evicted.
#[test]
fn restored_blocks_rebuild_the_same_chains() {
    let seed = crate::kv::hash::random_seed();
    println!("seed {seed}");
    let mut state = seed;
    for round in 0..20 {
        let mut original = PrefixCache::new(64, 0);
        let salts: [Option<Arc<str>>; 3] = [None, Some("a".into()), Some("b".into())];
        let mut prompts = Vec::new();
        for _ in 0..8 {
            let shared = prompt(1 + next(&mut state) as usize % 3, round);
            let mut p = shared.clone();
            p.extend(prompt(next(&mut state) as usize % 3, next(&mut state) as u32));
            let salt = salts[next(&mut state) as usize % 3].clone();
            let blocks = run(&mut original, &p, salt.as_ref());
            release_all(&mut original, &blocks);
            prompts.push((p, salt));
        }
        let listed = original.cached_blocks();
        assert_eq!(listed.len(), original.num_cached());
        for capacity in [64, 1 + next(&mut state) as usize % listed.len()] {
            let mut copy = PrefixCache::new(capacity, 0);
            let mut keys: Vec<Option<BlockKey>> = Vec::new();
            for b in &listed {
                let parent = b.parent.map(|p| keys[p].expect("a parent is restored before its children"));
                let filled = std::cell::Cell::new(false);
                let key = copy
                    .restore(parent, &b.tokens, b.salt.as_ref(), |_| {
                        filled.set(true);
                        Ok(())
                    })
                    .unwrap();
                assert_eq!(key.is_some(), filled.get());
                copy.check().unwrap();
                if key.is_none() {
                    break; // no free block left: the rest would not fit either
                }
                keys.push(key);
            }
            assert_eq!(copy.num_cached(), keys.len().min(capacity));
            assert_eq!(copy.stats().evictions, 0);
            for (p, salt) in &prompts {
                let found = copy.lookup(p, salt.as_deref(), usize::MAX).cached_tokens;
                let want = original.lookup(p, salt.as_deref(), usize::MAX).cached_tokens;
                if capacity == 64 {
                    assert_eq!(found, want);
                } else {
                    assert!(found <= want);
                }
            }
        }
    }
}

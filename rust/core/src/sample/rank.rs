//! Ranking: the ids of the `n` largest values of a slice, largest first, ties to the lower id.
//! Shared by top-k and by the top logprobs, so both break ties the same way. Values must not be NaN;
//! `-0.0` and `0.0` are equal, as they are for the greedy argmax.

use std::cmp::Ordering;

/// Up to this many, a single pass with a small sorted list beats selecting over all ids.
const SMALL: usize = 64;

/// Descending by value, then ascending by id.
pub(crate) fn by_value_desc(x: &[f32]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    move |&a, &b| {
        let (va, vb) = (x[a as usize], x[b as usize]);
        vb.partial_cmp(&va).unwrap_or(Ordering::Equal).then(a.cmp(&b))
    }
}

/// Fills `out` with the ids of the `n` largest values of `x` (all of them if `n >= x.len()`).
pub(crate) fn highest(x: &[f32], n: usize, out: &mut Vec<u32>) {
    out.clear();
    let n = n.min(x.len());
    if n == 0 {
        return;
    }
    if n <= SMALL {
        highest_small(x, n, out);
        return;
    }
    out.extend(0..x.len() as u32);
    if n < out.len() {
        out.select_nth_unstable_by(n - 1, by_value_desc(x));
        out.truncate(n);
    }
    out.sort_unstable_by(by_value_desc(x));
}

/// Values a pass over [`highest_small`] tests at once before looking at any of them alone.
const CHUNK: usize = 64;

/// One pass keeping a descending list of at most `n` ids. Ids arrive in ascending order, so a value
/// equal to the list's last never displaces it. Once the list is full, a chunk with no value above
/// its last is skipped on one test (a loop without early exit, which vectorizes): over a 152k
/// vocabulary almost every chunk is, and the per-value branch was most of a top-k draw.
fn highest_small(x: &[f32], n: usize, out: &mut Vec<u32>) {
    // The value a newcomer must beat once the list is full (-inf admits everything until then).
    let mut floor = f32::NEG_INFINITY;
    for (c, chunk) in x.chunks(CHUNK).enumerate() {
        if out.len() == n && !chunk.iter().fold(false, |above, &v| above | (v > floor)) {
            continue;
        }
        for (j, &v) in chunk.iter().enumerate() {
            if out.len() == n && v <= floor {
                continue;
            }
            let at = out.partition_point(|&k| x[k as usize] >= v);
            if out.len() == n {
                out.pop();
            }
            out.insert(at, (c * CHUNK + j) as u32);
            if out.len() == n {
                floor = x[out[n - 1] as usize];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::Rng;

    fn brute_force(x: &[f32], n: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..x.len() as u32).collect();
        ids.sort_by(by_value_desc(x));
        ids.truncate(n);
        ids
    }

    #[test]
    fn the_chunked_pass_matches_a_full_sort_over_long_rows() {
        // Long rows of continuous values (the list fills early, later chunks are mostly skipped),
        // and rising ones (every chunk holds a new maximum).
        let mut rng = Rng::new(3);
        for case in 0..40 {
            let len = 1 + (rng.next_u64() % 5000) as usize;
            let rising = case % 4 == 0;
            let x: Vec<f32> =
                (0..len).map(|i| if rising { i as f32 * 0.01 } else { rng.next_f64() as f32 * 10.0 - 5.0 }).collect();
            let n = 1 + (rng.next_u64() % SMALL as u64) as usize;
            let mut got = Vec::new();
            highest(&x, n, &mut got);
            assert_eq!(got, brute_force(&x, n), "case {case}, len {len}, n {n}");
        }
    }

    #[test]
    fn both_paths_match_a_full_sort_including_ties() {
        let mut rng = Rng::new(11);
        for case in 0..300 {
            let len = 1 + (rng.next_u64() % 400) as usize;
            // Few distinct values, so ties are common; some -inf and signed zeros.
            let x: Vec<f32> = (0..len)
                .map(|_| match rng.next_u64() % 12 {
                    0 => f32::NEG_INFINITY,
                    1 => -0.0,
                    v => v as f32 - 6.0,
                })
                .collect();
            let n = (rng.next_u64() % (len as u64 + 100)) as usize;
            let mut got = Vec::new();
            highest(&x, n, &mut got);
            assert_eq!(got, brute_force(&x, n), "case {case}, n {n}");
        }
    }
}

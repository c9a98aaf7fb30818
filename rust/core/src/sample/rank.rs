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

/// One pass keeping a descending list of at most `n` ids. Ids arrive in ascending order, so a value
/// equal to the list's last never displaces it.
fn highest_small(x: &[f32], n: usize, out: &mut Vec<u32>) {
    // The value a newcomer must beat once the list is full (-inf admits everything until then).
    let mut floor = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if out.len() == n && v <= floor {
            continue;
        }
        let at = out.partition_point(|&j| x[j as usize] >= v);
        if out.len() == n {
            out.pop();
        }
        out.insert(at, i as u32);
        if out.len() == n {
            floor = x[out[n - 1] as usize];
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

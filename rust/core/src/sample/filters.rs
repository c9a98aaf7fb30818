//! Steps 5-8 of the pipeline: temperature, top-k, top-p and min-p over a candidate list.
//!
//! Candidates are token ids. [`top_k`] ranks the penalized logits themselves; [`weights`] then turns
//! the candidates' entries of the logits into `exp((x - max) / temperature)` (the best token's weight
//! is exactly 1). Entries of non-candidates are stale and must never be read. Every filter leaves the
//! candidates in ascending id order, the order the draw walks; ties in probability go to the lower id.

use std::cmp::Ordering;

use super::math::{exp_in_place, exp_nonpositive, sum};
use super::rank::{by_value_desc, highest};

/// Keeps the `k` highest candidates out of all `x.len()` tokens (all of them when `k` is 0).
pub(crate) fn top_k(x: &[f32], cand: &mut Vec<u32>, k: usize) {
    if k == 0 || k >= x.len() {
        cand.clear();
        cand.extend(0..x.len() as u32);
    } else {
        highest(x, k, cand);
        cand.sort_unstable();
    }
}

/// Replaces the candidates' logits by their weights `exp((x - max) / t)` and returns their sum.
/// When every token is a candidate this is one vectorized pass over the whole vocabulary.
pub(crate) fn weights(x: &mut [f32], cand: &[u32], max: f32, t: f32) -> f64 {
    if cand.len() == x.len() {
        exp_in_place(x, max, t);
        return sum(x);
    }
    let scale = 1.0 / t;
    cand.iter()
        .map(|&i| {
            // As `exp_in_place` computes it, so a token's weight does not depend on the filters.
            let shifted = x[i as usize] - max;
            let w = exp_nonpositive(if scale.is_finite() { shifted * scale } else { shifted / t });
            x[i as usize] = w;
            w as f64
        })
        .sum()
}

/// Top-p over weights `w` whose sum over `cand` is `z`, then min-p (weights are relative to the best
/// token's weight 1). Both keep a prefix of the candidates in descending order, so the result is the
/// shorter prefix.
pub(crate) fn top_p_min_p(w: &[f32], cand: &mut Vec<u32>, z: f64, top_p: f32, min_p: f32) {
    if top_p >= 1.0 {
        if cand.len() == w.len() {
            // Positive floats order as their bits; the few tokens min-p keeps come from a scan.
            cand.clear();
            scan(w, |b| b >= min_p.to_bits(), cand);
        } else {
            cand.retain(|&i| w[i as usize] >= min_p);
        }
        return;
    }
    // A token of weight below `cut` has less than half of 1 - top_p of the mass at or after it in
    // sorted order (at most `len` tokens, none heavier), so the tokens before it already exceed
    // top_p: it is outside the top-p set, whatever the rounding.
    let cut = (0.5 * (1.0 - top_p as f64) * z / cand.len() as f64) as f32;
    let floor = cut.max(min_p);
    if cand.len() >= HISTOGRAM_FROM {
        top_p_by_histogram(w, cand, top_p as f64 * z, floor);
        return;
    }
    cand.retain(|&i| w[i as usize] >= floor);
    let kept = top_p_prefix(w, cand, top_p as f64 * z);
    cand.truncate(kept);
    cand.sort_unstable();
}

/// Candidates from which [`top_p_by_histogram`] replaces the cut and the quickselect: a flat
/// distribution keeps most of a 152k vocabulary after the cut, and the quickselect's comparator took
/// ~5 ms over them.
const HISTOGRAM_FROM: usize = 4096;

/// Bits of a weight's mantissa below a fine bucket ([`top_p_by_histogram`]).
const FINE_SHIFT: u32 = 13;

/// Keeps the top-p set of `cand` (ascending ids, weights in [0, 1]) in id order, as [`top_p_prefix`]
/// defines it, and of those the tokens of weight at least `floor` (min-p, and the cut no top-p token
/// falls below). Positive floats order as their bits, so a radix select finds the boundary: one
/// pass for the mass per exponent, the exponents walked from the heaviest to the one where the mass
/// reaches `target`; that exponent's tokens collected (a vectorized scan) and their mass taken per
/// 10 more bits; the tokens of the fine bucket where it reaches `target` sorted; and one scan for the
/// set, which is every token heavier than the last one kept (ties to the lower id).
fn top_p_by_histogram(w: &[f32], cand: &mut Vec<u32>, target: f64, floor: f32) {
    let all = cand.len() == w.len();
    let bits = |i: u32| w[i as usize].to_bits();
    let mass = if all { exponent_mass(w.iter().copied()) } else { exponent_mass(cand.iter().map(|&i| w[i as usize])) };
    let (exponent, mut before) = heaviest_reaching(&mass, 0.0, target);
    let exponent = exponent as u32;
    let in_exponent = |b: u32| b >> 23 == exponent;
    let mut members = Vec::new();
    if all {
        scan(w, in_exponent, &mut members);
    } else {
        members.extend(cand.iter().copied().filter(|&i| in_exponent(bits(i))));
    }
    let fine_of = |i: u32| ((bits(i) >> FINE_SHIFT) & 1023) as usize;
    let mut fine = vec![0f64; 1024];
    for &i in &members {
        fine[fine_of(i)] += w[i as usize] as f64;
    }
    let (edge, fine_before) = heaviest_reaching(&fine, before, target);
    before = fine_before;
    members.retain(|&i| fine_of(i) == edge);
    let by = by_value_desc(w);
    members.sort_unstable_by(&by);
    let mut last = None;
    for &i in &members {
        if before >= target {
            break;
        }
        last = Some(i);
        before += w[i as usize] as f64;
    }
    // The set: every token the sorted walk reaches first (the last one kept or above), else every
    // token above the edge bucket; none below `floor`. All are at least `lowest`.
    let above_edge = ((exponent << 10 | edge as u32) + 1) << FINE_SHIFT;
    let keep = |i: u32| {
        w[i as usize] >= floor
            && match last {
                Some(l) => by(&i, &l) != Ordering::Greater,
                None => bits(i) >= above_edge,
            }
    };
    if all {
        let lowest = last.map_or(above_edge, bits).max(floor.to_bits());
        cand.clear();
        let mut heavy = Vec::new();
        scan(w, |b| b >= lowest, &mut heavy);
        cand.extend(heavy.into_iter().filter(|&i| keep(i)));
    } else {
        cand.retain(|&i| keep(i));
    }
}

/// The weights' mass per exponent (0..=127: a weight is at most 1). Four histograms take turns, so
/// neighbours of one exponent (most weights share a few) do not wait on each other's addition: one
/// histogram made the pass a chain of dependent stores and loads, most of a top-p draw's time.
fn exponent_mass(weights: impl Iterator<Item = f32>) -> [f64; 128] {
    let mut mass = [[0f64; 128]; 4];
    for (k, v) in weights.enumerate() {
        mass[k % 4][(v.to_bits() >> 23) as usize & 127] += v as f64;
    }
    std::array::from_fn(|e| (mass[0][e] + mass[1][e]) + (mass[2][e] + mass[3][e]))
}

/// The bucket of `mass` (walked from the last, the heaviest) where `before` plus the mass of the
/// buckets above it and its own first reaches `target`, and the mass before it (the first bucket if
/// rounding never reaches `target`).
fn heaviest_reaching(mass: &[f64], mut before: f64, target: f64) -> (usize, f64) {
    let mut edge = mass.len() - 1;
    while edge > 0 && before + mass[edge] < target {
        before += mass[edge];
        edge -= 1;
    }
    (edge, before)
}

/// Appends to `out`, in order, the indices of `w` whose bits pass `test`; 64-value chunks with none
/// are skipped on one vectorized test.
fn scan(w: &[f32], test: impl Fn(u32) -> bool, out: &mut Vec<u32>) {
    for (c, chunk) in w.chunks(64).enumerate() {
        if !chunk.iter().fold(false, |any, v| any | test(v.to_bits())) {
            continue;
        }
        let base = (c * 64) as u32;
        out.extend(chunk.iter().enumerate().filter(|(_, v)| test(v.to_bits())).map(|(j, _)| base + j as u32));
    }
}

/// Moves the top-p set to the front of `cand` and returns its size: the tokens, in descending order,
/// whose mass before them is below `target`. A quickselect on mass, O(len) expected, instead of a
/// sort: each round partitions the undecided range around its middle and keeps one side.
fn top_p_prefix(w: &[f32], cand: &mut [u32], target: f64) -> usize {
    let by = by_value_desc(w);
    // cand[..lo] is kept (heavier than the rest, mass `before`); cand[hi..] is dropped.
    let (mut lo, mut hi, mut before) = (0, cand.len(), 0.0f64);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        cand[lo..hi].select_nth_unstable_by(mid - lo, &by);
        let heavier: f64 = cand[lo..mid].iter().map(|&i| w[i as usize] as f64).sum();
        if before + heavier < target {
            before += heavier + w[cand[mid] as usize] as f64;
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    // The heaviest token has nothing before it (0 < target), so `lo >= 1` unless `cand` was empty.
    lo.max(1).min(cand.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_the_highest_with_ties_to_the_lower_id() {
        let x = [1.0, 3.0, 2.0, 3.0, 2.0, f32::NEG_INFINITY];
        let mut cand = Vec::new();
        top_k(&x, &mut cand, 3);
        assert_eq!(cand, [1, 2, 3]);
        top_k(&x, &mut cand, 0);
        assert_eq!(cand, [0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn weights_are_relative_to_the_max_and_zero_for_minus_inf() {
        let mut x = [1.0, 3.0, f32::NEG_INFINITY];
        let z = weights(&mut x, &[0, 1, 2], 3.0, 2.0);
        assert_eq!(x[1], 1.0);
        assert!((x[0] - (-1f32).exp()).abs() < 1e-7);
        assert_eq!(x[2], 0.0);
        assert!((z - 1.0 - (-1f64).exp()).abs() < 1e-6);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_the_mass() {
        // Probabilities 0.4, 0.3, 0.2, 0.1 (ids shuffled).
        let w = [0.2f32, 0.4, 0.1, 0.3];
        let cases =
            [(0.3, vec![1]), (0.4, vec![1]), (0.5, vec![1, 3]), (0.75, vec![0, 1, 3]), (0.95, vec![0, 1, 2, 3])];
        for (top_p, want) in cases {
            let mut cand = vec![0, 1, 2, 3];
            top_p_min_p(&w, &mut cand, 1.0, top_p, 0.0);
            assert_eq!(cand, want, "top_p {top_p}");
        }
    }

    #[test]
    fn top_p_prefix_matches_a_sorted_walk() {
        let mut rng = crate::sample::Rng::new(3);
        for case in 0..500 {
            let len = 1 + (rng.next_u64() % 300) as usize;
            // Coarse values so that ties are common.
            let w: Vec<f32> = (0..len).map(|_| (rng.next_u64() % 8) as f32 / 8.0 + 0.125).collect();
            let z: f64 = w.iter().map(|&v| v as f64).sum();
            let target = (0.01 + 0.98 * rng.next_f64()) * z;
            let mut sorted: Vec<u32> = (0..len as u32).collect();
            sorted.sort_by(by_value_desc(&w));
            let (mut before, mut want) = (0.0, 0);
            while want < len && before < target {
                before += w[sorted[want] as usize] as f64;
                want += 1;
            }
            let mut cand: Vec<u32> = (0..len as u32).collect();
            let kept = top_p_prefix(&w, &mut cand, target);
            let mut got = cand[..kept].to_vec();
            got.sort_unstable();
            let mut want_ids = sorted[..want].to_vec();
            want_ids.sort_unstable();
            assert_eq!(got, want_ids, "case {case}");
        }
    }

    /// Both ways of finding the top-p set (the quickselect below `HISTOGRAM_FROM` candidates, the
    /// weight histogram from there) give the sorted walk's set in id order, with ties (coarse
    /// weights) and widely spread weights across the boundary.
    #[test]
    fn top_p_keeps_the_sorted_walks_set_in_id_order_for_any_size() {
        let mut rng = crate::sample::Rng::new(11);
        for len in [50, 3000, HISTOGRAM_FROM, 20_000] {
            for case in 0..6 {
                let w: Vec<f32> = (0..len)
                    .map(|_| match case % 2 {
                        0 => (rng.next_u64() % 6) as f32 / 6.0 + 0.1,
                        _ => (-(rng.next_f64() * 12.0) as f32).exp(),
                    })
                    .collect();
                let z: f64 = w.iter().map(|&v| v as f64).sum();
                let top_p = (0.05 + 0.9 * rng.next_f64()) as f32;
                let mut sorted: Vec<u32> = (0..len as u32).collect();
                sorted.sort_by(by_value_desc(&w));
                let (mut before, mut n) = (0.0, 0);
                while n < len && before < top_p as f64 * z {
                    before += w[sorted[n] as usize] as f64;
                    n += 1;
                }
                let mut want = sorted[..n.max(1)].to_vec();
                want.sort_unstable();
                let mut cand: Vec<u32> = (0..len as u32).collect();
                top_p_min_p(&w, &mut cand, z, top_p, 0.0);
                assert_eq!(cand, want, "len {len} case {case} top_p {top_p}");
            }
        }
    }

    /// The histogram over a proper subset of the ids (a top-k of 4096 or more before top-p) keeps
    /// the sorted walk's set of that subset, and min-p on top of it.
    #[test]
    fn top_p_over_a_large_subset_keeps_its_sorted_walks_set() {
        let mut rng = crate::sample::Rng::new(5);
        for case in 0..8 {
            let w: Vec<f32> = (0..30_000).map(|_| (-(rng.next_f64() * 14.0) as f32).exp()).collect();
            let subset: Vec<u32> = (0..30_000u32).filter(|_| rng.next_f64() < 0.4).collect();
            let z: f64 = subset.iter().map(|&i| w[i as usize] as f64).sum();
            let top_p = (0.05 + 0.9 * rng.next_f64()) as f32;
            let min_p = if case % 2 == 0 { 0.0 } else { 0.3 };
            let mut sorted = subset.clone();
            sorted.sort_by(by_value_desc(&w));
            let (mut before, mut n) = (0.0, 0);
            while n < sorted.len() && before < top_p as f64 * z {
                before += w[sorted[n] as usize] as f64;
                n += 1;
            }
            let mut want: Vec<u32> = sorted[..n.max(1)].iter().copied().filter(|&i| w[i as usize] >= min_p).collect();
            want.sort_unstable();
            let mut cand = subset.clone();
            top_p_min_p(&w, &mut cand, z, top_p, min_p);
            assert_eq!(cand, want, "case {case} top_p {top_p}");
        }
    }

    #[test]
    fn min_p_is_relative_to_the_best_weight_and_keeps_equality() {
        let w = [1.0f32, 0.5, 0.25, 0.5];
        let mut cand = vec![0, 1, 2, 3];
        top_p_min_p(&w, &mut cand, 2.25, 1.0, 0.5);
        assert_eq!(cand, [0, 1, 3]);
    }
}

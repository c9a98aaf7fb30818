//! The sampler against a brute-force model of the whole pipeline (full sorts, f64), on fresh random
//! small vocabularies; seeding, greedy ties, logprobs and independence from other requests.

mod common;

use common::Rng as TestRng;
use oxibonsai_core::sample::{History, Rng, Sampler, SamplingConfig};
use oxibonsai_core::Error;

/// The final distribution of the pipeline and how far the inputs are from any filter's boundary
/// (cases closer than rounding could flip are skipped, not compared).
fn brute_force(logits: &[f32], h: &History<'_>, banned: &[u32], c: &SamplingConfig) -> (Vec<f64>, f64) {
    let mut x: Vec<f64> = logits.iter().map(|&v| v as f64).collect();
    let mut seen: Vec<u32> = h.prompt.iter().chain(h.output).copied().collect();
    seen.sort_unstable();
    seen.dedup();
    for &t in &seen {
        let v = x[t as usize];
        let p = c.repetition_penalty as f64;
        x[t as usize] = if v > 0.0 { v / p } else { v * p };
    }
    let mut out: Vec<u32> = h.output.to_vec();
    out.sort_unstable();
    out.dedup();
    for &t in &out {
        let count = h.output.iter().filter(|&&o| o == t).count() as f64;
        x[t as usize] -= c.frequency_penalty as f64 * count + c.presence_penalty as f64;
    }
    for &b in banned {
        x[b as usize] = f64::NEG_INFINITY;
    }
    let mut order: Vec<usize> = (0..x.len()).filter(|&i| x[i] > f64::NEG_INFINITY).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    let mut probs = vec![0.0; x.len()];
    // Relative distance from a boundary value to the nearest other value: exact ties are decided by id
    // on both sides, nearly equal values may swap under f32 rounding.
    let gap = |values: &[f64], b: f64| {
        let nearest = values.iter().filter(|v| v.is_finite() && **v != b).map(|v| (v - b).abs());
        nearest.fold(f64::INFINITY, f64::min) / (1.0 + b.abs())
    };
    if c.is_greedy() {
        probs[order[0]] = 1.0;
        return (probs, gap(&x, x[order[0]]));
    }
    let mut margin = f64::INFINITY;
    let y: Vec<f64> = x.iter().map(|v| (v - x[order[0]]) / c.temperature as f64).collect();
    if c.top_k > 0 && (c.top_k as usize) < order.len() {
        let k = c.top_k as usize;
        margin = margin.min(gap(&y, y[order[k - 1]])).min(gap(&y, y[order[k]]));
        order.truncate(k);
    }
    let w: Vec<f64> = order.iter().map(|&i| y[i].exp()).collect();
    let z: f64 = w.iter().sum();
    let kept = if c.top_p < 1.0 { top_p_prefix(&w, z, c.top_p as f64, &mut margin) } else { w.len() };
    if kept < w.len() {
        // Near-equal tokens on both sides of the cut may swap under rounding.
        margin = margin.min(gap(&y, y[order[kept - 1]])).min(gap(&y, y[order[kept]]));
    }
    let mut total = 0.0;
    for (j, &i) in order[..kept].iter().enumerate() {
        if c.min_p > 0.0 && w[j] != c.min_p as f64 {
            margin = margin.min((w[j] - c.min_p as f64).abs());
        }
        if w[j] >= c.min_p as f64 {
            probs[i] = w[j];
            total += w[j];
        }
    }
    probs.iter_mut().for_each(|p| *p /= total);
    (probs, margin)
}

/// How many of the descending weights `w` (sum `z`) the top-p filter keeps.
fn top_p_prefix(w: &[f64], z: f64, top_p: f64, margin: &mut f64) -> usize {
    let mut before = 0.0;
    for (kept, &wi) in w.iter().enumerate() {
        *margin = margin.min((before / z - top_p).abs());
        if before / z >= top_p && kept > 0 {
            return kept;
        }
        before += wi;
    }
    w.len()
}

fn random_logits(rng: &mut TestRng, n: usize) -> Vec<f32> {
    let scale = 0.3 + 4.0 * rng.uniform();
    let mut logits: Vec<f32> = (0..n).map(|_| scale * rng.normal()).collect();
    for _ in 0..(rng.next_u64() % 3) {
        logits[(rng.next_u64() % n as u64) as usize] = f32::NEG_INFINITY;
    }
    if rng.uniform() < 0.3 {
        // Exact ties exercise the tie rules.
        let (a, b) = ((rng.next_u64() % n as u64) as usize, (rng.next_u64() % n as u64) as usize);
        logits[a] = logits[b];
    }
    logits
}

fn random_ids(rng: &mut TestRng, n: usize, len: usize) -> Vec<u32> {
    (0..rng.next_u64() as usize % (len + 1)).map(|_| (rng.next_u64() % n as u64) as u32).collect()
}

fn pick<T: Copy>(rng: &mut TestRng, options: &[T]) -> T {
    options[(rng.next_u64() % options.len() as u64) as usize]
}

/// Compares `probabilities` with the brute force over `cases` random inputs built by `config`.
fn check_against_brute_force(test: &str, cases: usize, config: impl Fn(&mut TestRng) -> SamplingConfig) {
    let mut rng = TestRng::fresh(test);
    let mut compared = 0;
    for case in 0..cases {
        let n = 2 + (rng.next_u64() % 200) as usize;
        let logits = random_logits(&mut rng, n);
        let (prompt, output) = (random_ids(&mut rng, n, 20), random_ids(&mut rng, n, 20));
        let banned = random_ids(&mut rng, n, 2);
        let c = config(&mut rng);
        let h = History::new(&prompt, &output);
        let sampler = Sampler::new(c, 0).unwrap();
        let got = match sampler.probabilities(&logits, &h, &banned) {
            Err(Error::Value(msg)) if msg.starts_with("no token can be sampled") => continue,
            other => other.unwrap(),
        };
        let (want, margin) = brute_force(&logits, &h, &banned, &c);
        if margin < 1e-4 {
            continue;
        }
        compared += 1;
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!((g as f64 - w).abs() <= 1e-5 + 1e-4 * w, "case {case} token {i}: {g} vs {w}, config {c:?}");
        }
        let sum: f64 = got.iter().map(|&p| p as f64).sum();
        assert!((sum - 1.0).abs() < 1e-5, "case {case}: probabilities sum to {sum}");
    }
    println!("{test}: compared {compared} of {cases} cases");
    assert!(compared > cases / 2, "only {compared} of {cases} cases were far enough from a boundary");
}

#[test]
fn temperature_only_matches_brute_force() {
    check_against_brute_force("temperature", 300, |r| SamplingConfig {
        temperature: pick(r, &[0.1, 0.5, 1.0, 2.0]),
        ..Default::default()
    });
}

#[test]
fn top_k_matches_brute_force() {
    check_against_brute_force("top_k", 300, |r| SamplingConfig {
        temperature: pick(r, &[0.5, 1.0]),
        top_k: pick(r, &[2, 3, 10, 50, 500]),
        ..Default::default()
    });
}

#[test]
fn top_p_matches_brute_force() {
    check_against_brute_force("top_p", 300, |r| SamplingConfig {
        temperature: pick(r, &[0.5, 1.0, 3.0]),
        top_p: 0.05 + 0.95 * r.uniform(),
        ..Default::default()
    });
}

#[test]
fn min_p_matches_brute_force() {
    check_against_brute_force("min_p", 300, |r| SamplingConfig {
        temperature: pick(r, &[0.5, 1.0, 3.0]),
        min_p: pick(r, &[0.0, 0.01, 0.2, 0.9, 1.0]),
        ..Default::default()
    });
}

#[test]
fn penalties_and_all_filters_match_brute_force() {
    check_against_brute_force("all", 500, |r| SamplingConfig {
        temperature: pick(r, &[0.0, 0.3, 1.0, 1.5]),
        top_k: pick(r, &[0, 0, 1, 5, 40]),
        top_p: pick(r, &[1.0, 0.9, 0.5, 0.1]),
        min_p: pick(r, &[0.0, 0.05, 0.5]),
        repetition_penalty: pick(r, &[1.0, 0.8, 1.3, 3.0]),
        presence_penalty: pick(r, &[0.0, 1.0, -0.5]),
        frequency_penalty: pick(r, &[0.0, 0.4, -1.2]),
    });
}

/// Greedy sampling with no penalty and no ban skips the scratch copy and the penalty step: the same
/// tokens, logprobs and errors as the general path, which a neutral-in-effect penalty (no history)
/// forces. Random logits with ties and `-inf`.
#[test]
fn plain_greedy_equals_the_general_greedy_path() {
    let mut rng = TestRng::fresh("plain greedy");
    let general = SamplingConfig { repetition_penalty: 1.5, ..SamplingConfig::greedy() };
    let mut plain = Sampler::new(SamplingConfig::greedy(), 0).unwrap();
    let mut full = Sampler::new(general, 0).unwrap();
    let h = History::default();
    for _ in 0..200 {
        let vocab = 1 + (rng.next_u64() % 300) as usize;
        let logits: Vec<f32> = (0..vocab)
            .map(|_| match rng.next_u64() % 6 {
                0 => f32::NEG_INFINITY,
                1 => 3.0, // ties
                _ => rng.normal(),
            })
            .collect();
        for n in [None, Some(0), Some(3)] {
            let (a, b) = (plain.sample(&logits, &h, &[], n), full.sample(&logits, &h, &[], n));
            match (a, b) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{logits:?} {n:?}"),
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                (a, b) => panic!("{a:?} vs {b:?} for {logits:?}"),
            }
        }
    }
    let bad_history = History::new(&[7], &[]);
    for logits in [vec![0.0, f32::NAN], vec![f32::INFINITY], vec![], vec![f32::NEG_INFINITY; 3]] {
        for h in [&h, &bad_history] {
            let (a, b) = (plain.sample(&logits, h, &[], None), full.sample(&logits, h, &[], None));
            assert_eq!(a.unwrap_err().to_string(), b.unwrap_err().to_string(), "{logits:?}");
        }
    }
}

#[test]
fn no_logprobs_asked_none_computed() {
    let logits = [0.5, 2.0, -1.0];
    for config in [SamplingConfig::greedy(), SamplingConfig::default()] {
        let got = Sampler::new(config, 3).unwrap().sample(&logits, &History::default(), &[], None).unwrap();
        assert_eq!((got.logprob, got.top.len()), (None, 0));
        let with = Sampler::new(config, 3).unwrap().sample(&logits, &History::default(), &[], Some(1)).unwrap();
        assert_eq!(with.token, got.token);
        assert!(with.logprob.is_some() && with.top.len() == 1);
    }
}

#[test]
fn greedy_takes_the_argmax_with_ties_to_the_lowest_id() {
    for config in [SamplingConfig::greedy(), SamplingConfig { top_k: 1, temperature: 5.0, ..Default::default() }] {
        let mut sampler = Sampler::new(config, 1).unwrap();
        let logits = [0.5, 2.0, -1.0, 2.0, 2.0];
        let h = History::default();
        for _ in 0..5 {
            assert_eq!(sampler.sample(&logits, &h, &[], Some(0)).unwrap().token, 1);
        }
        assert_eq!(sampler.sample(&logits, &h, &[1], Some(0)).unwrap().token, 3);
        assert_eq!(sampler.probabilities(&logits, &h, &[]).unwrap(), [0.0, 1.0, 0.0, 0.0, 0.0]);
    }
}

fn sequence(seed: u64, logits: &[f32], steps: usize) -> Vec<u32> {
    let config = SamplingConfig { temperature: 1.0, top_p: 0.95, ..Default::default() };
    let mut sampler = Sampler::new(config, seed).unwrap();
    (0..steps).map(|_| sampler.sample(logits, &History::default(), &[], Some(0)).unwrap().token).collect()
}

#[test]
fn a_seed_gives_a_fixed_sequence_and_another_seed_a_different_one() {
    let mut rng = TestRng::fresh("seed");
    let logits: Vec<f32> = (0..1000).map(|_| 0.1 * rng.normal()).collect();
    let seed = rng.next_u64();
    assert_eq!(sequence(seed, &logits, 64), sequence(seed, &logits, 64));
    assert_ne!(sequence(seed, &logits, 64), sequence(seed ^ 1, &logits, 64));
}

#[test]
fn a_request_does_not_depend_on_other_requests() {
    let mut rng = TestRng::fresh("independent");
    let a: Vec<f32> = (0..500).map(|_| rng.normal()).collect();
    let b: Vec<f32> = (0..700).map(|_| rng.normal()).collect();
    let config = SamplingConfig { temperature: 0.8, top_k: 50, repetition_penalty: 1.2, ..Default::default() };
    let alone = {
        let mut s = Sampler::new(config, 9).unwrap();
        let mut out = Vec::new();
        for _ in 0..20 {
            let t = s.sample(&a, &History::new(&[1, 2], &out), &[], Some(0)).unwrap().token;
            out.push(t);
        }
        out
    };
    let (mut s, mut other) = (Sampler::new(config, 9).unwrap(), Sampler::new(SamplingConfig::default(), 3).unwrap());
    let mut out = Vec::new();
    for _ in 0..20 {
        other.sample(&b, &History::new(&[5; 40], &[6, 6]), &[7], Some(5)).unwrap();
        let t = s.sample(&a, &History::new(&[1, 2], &out), &[], Some(0)).unwrap().token;
        out.push(t);
    }
    assert_eq!(out, alone);
}

#[test]
fn the_draw_is_the_inverse_cdf_in_id_order_of_one_uniform() {
    let mut rng = TestRng::fresh("draw");
    for _ in 0..200 {
        let logits: Vec<f32> = (0..50).map(|_| rng.normal()).collect();
        let config = SamplingConfig { temperature: 0.7, top_k: 20, top_p: 0.9, ..Default::default() };
        let seed = rng.next_u64();
        let probs = Sampler::new(config, seed).unwrap().probabilities(&logits, &History::default(), &[]).unwrap();
        let token =
            Sampler::new(config, seed).unwrap().sample(&logits, &History::default(), &[], Some(0)).unwrap().token;
        let u = Rng::new(seed).next_f64();
        let mut running = 0.0;
        let cdf: Vec<f64> = probs
            .iter()
            .map(|&p| {
                running += p as f64;
                running
            })
            .collect();
        let want = cdf.iter().position(|&c| u < c).unwrap_or(probs.len() - 1);
        if cdf.iter().all(|&c| (c - u).abs() > 1e-5) {
            assert_eq!(token as usize, want);
        }
        assert!(probs[token as usize] > 0.0);
    }
}

#[test]
fn logprobs_are_the_raw_log_softmax_sorted_descending() {
    let mut rng = TestRng::fresh("logprobs");
    let mut logits: Vec<f32> = (0..300).map(|_| 3.0 * rng.normal()).collect();
    logits[7] = f32::NEG_INFINITY;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    let config = SamplingConfig { temperature: 0.5, repetition_penalty: 2.0, top_k: 5, ..Default::default() };
    let mut sampler = Sampler::new(config, 4).unwrap();
    let got = sampler.sample(&logits, &History::new(&[0, 1, 2], &[3]), &[], Some(10)).unwrap();
    assert!((got.logprob.unwrap() as f64 - (logits[got.token as usize] as f64 - lse)).abs() < 1e-5);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    assert_eq!(got.top.len(), 10);
    for (&(id, lp), &want) in got.top.iter().zip(&order) {
        assert_eq!(id as usize, want);
        assert!((lp as f64 - (logits[want] as f64 - lse)).abs() < 1e-5);
    }
    assert!(sampler.sample(&logits, &History::default(), &[], Some(0)).unwrap().top.is_empty());
}

#[test]
fn invalid_configs_are_refused_by_the_constructor() {
    let err = Sampler::new(SamplingConfig { top_p: 0.0, ..Default::default() }, 0).unwrap_err();
    assert_eq!(err, Error::Value("top_p must be in (0, 1], got 0".into()));
}

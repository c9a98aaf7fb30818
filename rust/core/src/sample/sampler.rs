//! `Sampler`: one request's config and random stream, and the pipeline that turns its logits into a
//! token. The steps themselves live in `bias`, `penalties`, `filters` and `logprobs`; this file only orders
//! them, validates the logits and makes the one draw.
//!
//! Draw order (fixed, so a seed gives a fixed sequence): the surviving candidates are walked in
//! ascending token id, accumulating their weights, and the first whose running sum exceeds
//! `u * total` is chosen, `u` being exactly one `Rng::next_f64()` per sampled token (with every token
//! a candidate, the running sum skips whole blocks of 256 ids on their sums first: [`draw_all`]).
//! Greedy sampling (temperature 0 or top-k 1) takes the argmax, ties to the lowest id, and draws
//! nothing.

use super::bias::LogitBias;
use super::config::SamplingConfig;
use super::mask::TokenMask;
use super::math::{max_and_bad, sum};
use super::penalties::{self, History};
use super::rng::Rng;
use super::scratch::{with_scratch, Scratch};
use super::{filters, logprobs};
use crate::{Error, Result};

/// One sampled token and its raw logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// The raw logprob (log_softmax of the unprocessed logits) of `token`, when asked for.
    pub logprob: Option<f32>,
    /// The `n` highest raw logprobs, descending, ties by ascending id.
    pub top: Vec<(u32, f32)>,
}

/// A request's sampler: its validated config, its logit bias and its own seeded random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    config: SamplingConfig,
    bias: LogitBias,
    rng: Rng,
}

impl Sampler {
    /// Validates `config` and seeds the stream.
    pub fn new(config: SamplingConfig, seed: u64) -> Result<Sampler> {
        config.validate()?;
        Ok(Sampler { config, bias: LogitBias::default(), rng: Rng::new(seed) })
    }

    /// This sampler, adding `bias` to the logits before everything else.
    pub fn with_bias(self, bias: LogitBias) -> Sampler {
        Sampler { bias, ..self }
    }

    pub fn config(&self) -> &SamplingConfig {
        &self.config
    }

    /// Samples one token from `logits` (finite or `-inf`), never one of `banned`. With
    /// `Some(n)` it also returns the token's raw logprob and the `n` highest raw logprobs; with
    /// `None` it computes no logprob at all (the log-normalizer is a pass of exponentials over the
    /// whole vocabulary, most of the cost of a greedy draw).
    pub fn sample(
        &mut self,
        logits: &[f32],
        history: &History<'_>,
        banned: &[u32],
        n_logprobs: Option<usize>,
    ) -> Result<Sampled> {
        self.sample_masked(logits, history, banned, None, n_logprobs)
    }

    /// [`sample`](Self::sample), never an id `mask` does not allow (structured output). The
    /// logprobs stay those of the raw logits.
    pub fn sample_masked(
        &mut self,
        logits: &[f32],
        history: &History<'_>,
        banned: &[u32],
        mask: Option<TokenMask<'_>>,
        n_logprobs: Option<usize>,
    ) -> Result<Sampled> {
        let plain = banned.is_empty() && self.bias.is_empty();
        if plain && self.config.is_greedy() && !self.config.has_penalties() {
            return match mask {
                None => plain_argmax(logits, history, n_logprobs),
                Some(mask) => masked_argmax(logits, history, mask, n_logprobs),
            };
        }
        check_logits(logits)?;
        with_scratch(|s| {
            let max = prepare(&self.config, &self.bias, logits, history, (banned, mask), s)?;
            let token = if self.config.is_greedy() {
                argmax(&s.logits, max)
            } else {
                let total = distribution(&self.config, s, max);
                draw(&s.logits, &s.cand, &s.kept, total, self.rng.next_f64())
            };
            Ok(with_logprobs(logits, token, n_logprobs, &mut s.cand))
        })
    }

    /// The distribution the draw would use: zero except for the candidates (one-hot when greedy).
    pub fn probabilities(&self, logits: &[f32], history: &History<'_>, banned: &[u32]) -> Result<Vec<f32>> {
        self.probabilities_masked(logits, history, banned, None)
    }

    /// [`probabilities`](Self::probabilities) under a token mask, as [`sample_masked`](Self::sample_masked).
    pub fn probabilities_masked(
        &self,
        logits: &[f32],
        history: &History<'_>,
        banned: &[u32],
        mask: Option<TokenMask<'_>>,
    ) -> Result<Vec<f32>> {
        check_logits(logits)?;
        with_scratch(|s| {
            let max = prepare(&self.config, &self.bias, logits, history, (banned, mask), s)?;
            let mut probs = vec![0.0; logits.len()];
            if self.config.is_greedy() {
                probs[argmax(&s.logits, max) as usize] = 1.0;
            } else {
                let total = distribution(&self.config, s, max);
                for &i in &s.cand {
                    probs[i as usize] = (s.logits[i as usize] as f64 / total) as f32;
                }
            }
            Ok(probs)
        })
    }
}

/// Greedy sampling with nothing to change the logits: the argmax of `logits` as given, found in two
/// passes (the checks fused with the maximum, then the first position of it) and without copying.
/// The same token and errors as the general path.
fn plain_argmax(logits: &[f32], history: &History<'_>, n_logprobs: Option<usize>) -> Result<Sampled> {
    let max = checked_max(logits)?;
    penalties::check_history(history, logits.len())?;
    if max == f32::NEG_INFINITY {
        return Err(no_token(logits.len()));
    }
    let token = argmax(logits, max);
    Ok(with_scratch(|s| with_logprobs(logits, token, n_logprobs, &mut s.cand)))
}

/// Greedy sampling under a token mask with nothing else to change the logits: the first largest
/// allowed logit, read in place (no copy, no pass over masked words). The same token and errors as
/// the general path.
fn masked_argmax(
    logits: &[f32],
    history: &History<'_>,
    mask: TokenMask<'_>,
    n_logprobs: Option<usize>,
) -> Result<Sampled> {
    mask.check(logits.len())?;
    check_logits(logits)?;
    penalties::check_history(history, logits.len())?;
    let token = mask.argmax(logits).ok_or_else(|| no_token(logits.len()))?;
    Ok(with_scratch(|s| with_logprobs(logits, token, n_logprobs, &mut s.cand)))
}

/// [`check_logits`] and the maximum in one pass.
fn checked_max(logits: &[f32]) -> Result<f32> {
    let (max, any_bad) = max_and_bad(logits);
    if any_bad || logits.is_empty() {
        check_logits(logits)?;
    }
    Ok(max)
}

/// `token` with its raw logprob and the `n` highest raw logprobs, if asked for (`ids` is scratch).
fn with_logprobs(logits: &[f32], token: u32, n_logprobs: Option<usize>, ids: &mut Vec<u32>) -> Sampled {
    let Some(n) = n_logprobs else {
        return Sampled { token, logprob: None, top: Vec::new() };
    };
    let lse = logprobs::log_normalizer(logits);
    Sampled { token, logprob: Some(logprobs::logprob(logits, lse, token)), top: logprobs::top(logits, lse, n, ids) }
}

fn no_token(vocab: usize) -> Error {
    Error::Value(format!("no token can be sampled: all {vocab} logits are -inf, banned or masked"))
}

/// Rejects empty logits, NaN and `+inf` (`-inf` marks a masked token).
fn check_logits(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(Error::Shape("logits must not be empty".into()));
    }
    // A fold without early exit vectorizes; the position is searched only when something is bad.
    let bad = |v: f32| v.is_nan() || v == f32::INFINITY;
    if !logits.iter().fold(false, |any, &v| any | bad(v)) {
        return Ok(());
    }
    let i = logits.iter().position(|&v| bad(v)).expect("a bad value was seen");
    Err(Error::Value(format!("logits[{i}] is {}; logits must be finite or -inf", logits[i])))
}

/// Steps 0-3 into the scratch copy (the token mask with the bans); returns the largest penalized
/// logit, or fails if every token is `-inf`, banned or masked.
fn prepare(
    config: &SamplingConfig,
    bias: &LogitBias,
    logits: &[f32],
    history: &History<'_>,
    (banned, mask): (&[u32], Option<TokenMask<'_>>),
    s: &mut Scratch,
) -> Result<f32> {
    if let Some(mask) = mask {
        mask.check(logits.len())?;
    }
    s.load(logits);
    bias.apply(&mut s.logits)?;
    penalties::apply(&mut s.logits, history, banned, config, &mut s.marks)?;
    if let Some(mask) = mask {
        mask.apply(&mut s.logits);
    }
    let max = max_and_bad(&s.logits).0;
    if max == f32::NEG_INFINITY {
        return Err(no_token(logits.len()));
    }
    Ok(max)
}

/// The first index holding `max` (ties go to the lowest id).
fn argmax(x: &[f32], max: f32) -> u32 {
    // Blocks of 64 are tested without early exit (a loop that vectorizes) before the scalar search.
    let block = x.chunks(64).position(|c| c.iter().fold(false, |hit, &v| hit | (v == max)));
    let start = 64 * block.expect("max is one of the values");
    let offset = x[start..].iter().position(|&v| v == max).expect("the block holds max");
    (start + offset) as u32
}

/// Steps 5-8 over penalized logits whose maximum is `max`: leaves the candidates in `s.cand`, their
/// weights in `s.logits` (and, for a proper subset of the vocabulary, in `s.kept` in candidate
/// order), and returns the total weight.
fn distribution(config: &SamplingConfig, s: &mut Scratch, max: f32) -> f64 {
    filters::top_k(&s.logits, &mut s.cand, config.top_k as usize);
    let z = filters::weights(&mut s.logits, &s.cand, max, config.temperature);
    if config.top_p < 1.0 || config.min_p > 0.0 {
        filters::top_p_min_p(&s.logits, &mut s.cand, z, config.top_p, config.min_p);
    }
    if s.cand.len() == s.logits.len() {
        return z;
    }
    s.kept.clear();
    s.kept.extend(s.cand.iter().map(|&i| s.logits[i as usize]));
    sum(&s.kept)
}

/// Step 9: inverse CDF over the candidates in their (ascending id) order with one uniform `u` in
/// [0, 1): the first candidate whose running weight (f64) exceeds `u * total`. With every token a
/// candidate the walk is over `w`, else over the candidates' weights `kept` (`s.kept` of
/// [`distribution`]).
fn draw(w: &[f32], cand: &[u32], kept: &[f32], total: f64, u: f64) -> u32 {
    let target = u * total;
    if cand.len() == w.len() {
        return draw_index(w, target) as u32;
    }
    cand[draw_index(kept, target)]
}

/// Weights a block of the draw sums at once.
const DRAW_BLOCK: usize = 256;

/// The first index of `weights` whose running sum exceeds `target`: the walk goes a block of
/// [`DRAW_BLOCK`] weights at a time on their sums ([`sum`]'s fixed order within a block), then one
/// weight at a time inside the block that crosses the target (the sequential f64 walk over a 152k
/// vocabulary was a chain of dependent additions, most of a sampled draw's time).
fn draw_index(weights: &[f32], target: f64) -> usize {
    let mut running = 0.0;
    for (b, block) in weights.chunks(DRAW_BLOCK).enumerate() {
        let after = running + sum(block);
        if target < after {
            for (j, &v) in block.iter().enumerate() {
                running += v as f64;
                if target < running {
                    return b * DRAW_BLOCK + j;
                }
            }
            continue; // rounding: the walk ended at or below the target; on to the next block
        }
        running = after;
    }
    // Only reached when rounding puts `target` at `total`: the last weight above zero.
    weights.iter().rposition(|&v| v > 0.0).expect("the best token has weight 1")
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Sampled {
        /// The raw logprob of `token` from this draw's top list.
        fn logprobs_of(&self, token: u32) -> f32 {
            self.top.iter().find(|(id, _)| *id == token).map_or(f32::NAN, |&(_, lp)| lp)
        }
    }

    #[test]
    fn argmax_ties_go_to_the_lowest_id() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NEG_INFINITY], 3.0), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, 0.0], 0.0), 1);
        assert_eq!(argmax(&[-0.0, 0.0], 0.0), 0);
        let mut long = vec![0.0; 1000];
        long[700] = 1.0;
        long[900] = 1.0;
        assert_eq!(argmax(&long, 1.0), 700);
    }

    #[test]
    fn draw_walks_candidates_in_order_and_skips_zero_weights() {
        let w = [0.0f32, 1.0, 0.0, 3.0];
        let cand = [0, 1, 2, 3];
        assert_eq!(draw(&w, &cand, &[], 4.0, 0.0), 1);
        assert_eq!(draw(&w, &cand, &[], 4.0, 0.2499), 1);
        assert_eq!(draw(&w, &cand, &[], 4.0, 0.25), 3);
        assert_eq!(draw(&w, &cand, &[], 4.0, 1.0), 3);
    }

    #[test]
    fn a_draw_over_some_ids_walks_their_kept_weights_in_id_order() {
        let w = [5.0f32, 1.0, 9.0, 3.0, 2.0];
        let cand = [1, 3, 4];
        let kept = [1.0, 3.0, 2.0];
        assert_eq!(draw(&w, &cand, &kept, 6.0, 0.0), 1);
        assert_eq!(draw(&w, &cand, &kept, 6.0, 1.0 / 6.0), 3);
        assert_eq!(draw(&w, &cand, &kept, 6.0, 0.66), 3);
        assert_eq!(draw(&w, &cand, &kept, 6.0, 0.67), 4);
        assert_eq!(draw(&w, &cand, &kept, 6.0, 1.0), 4);
    }

    #[test]
    fn the_blocked_draw_is_the_walk_over_every_id() {
        // Against the plain walk, over vocabularies that end mid-block, at targets on block edges.
        let mut rng = Rng::new(11);
        for n in [1, 255, 256, 257, 1000, 5000] {
            let w: Vec<f32> = (0..n).map(|_| if rng.next_f64() < 0.3 { 0.0 } else { rng.next_f64() as f32 }).collect();
            let mut w = w;
            w[n / 2] = 1.0;
            let total = sum(&w);
            let ids: Vec<u32> = (0..n as u32).collect();
            let walk = |target: f64| {
                let mut running = 0.0;
                for (i, &v) in w.iter().enumerate() {
                    running += v as f64;
                    if target < running {
                        return i as u32;
                    }
                }
                w.iter().rposition(|&v| v > 0.0).unwrap() as u32
            };
            let edges: Vec<f64> = w
                .chunks(DRAW_BLOCK)
                .scan(0.0, |acc, b| {
                    *acc += sum(b);
                    Some(*acc / total)
                })
                .collect();
            for u in (0..200).map(|_| rng.next_f64()).chain(edges).chain([0.0, 1.0 - f64::EPSILON]) {
                let got = draw(&w, &ids, &[], total, u.min(1.0 - f64::EPSILON));
                let want = walk(u.min(1.0 - f64::EPSILON) * total);
                // The running sums round differently in the two orders: only a target within
                // rounding of a boundary may land on a neighbour (never on a zero weight).
                assert!(w[got as usize] > 0.0, "n {n} u {u}: drew a zero weight");
                if got != want {
                    let lo = got.min(want) as usize;
                    let hi = got.max(want) as usize;
                    let between: f64 = w[lo..hi].iter().map(|&v| v as f64).sum::<f64>() - w[lo] as f64;
                    assert!(between <= 1e-9 * total, "n {n} u {u}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn the_bias_moves_greedy_and_sampled_draws_but_not_logprobs() {
        let logits = [2.0, 1.0, 0.0, -1.0];
        let h = History::default();
        let bias = LogitBias::new(vec![(0, -100.0), (3, 3.5)]).unwrap();
        let mut greedy = Sampler::new(SamplingConfig::greedy(), 0).unwrap().with_bias(bias.clone());
        let got = greedy.sample(&logits, &h, &[], Some(4)).unwrap();
        let plain = Sampler::new(SamplingConfig::greedy(), 0).unwrap().sample(&logits, &h, &[], Some(4)).unwrap();
        assert_eq!((got.token, plain.token), (3, 0));
        assert_eq!((got.logprob.unwrap(), &got.top), (plain.logprobs_of(3), &plain.top));
        assert!(got.logprob.unwrap() < -3.0, "the raw logprob, not the biased one");
        // Sampling: token 0 weighs exp(-98 - 2.5) against the rest, so 4,000 draws never take it.
        let sampler = Sampler::new(SamplingConfig::default(), 7).unwrap().with_bias(bias);
        let probs = sampler.probabilities(&logits, &h, &[]).unwrap();
        assert_eq!(probs[0], 0.0);
        let want = 2.5f64.exp() / (2.5f64.exp() + 1f64.exp() + 1.0);
        assert!((probs[3] as f64 - want).abs() < 1e-6, "{probs:?}");
        let mut sampler = sampler;
        assert!((0..4000).all(|_| sampler.sample(&logits, &h, &[], None).unwrap().token != 0));
    }

    #[test]
    fn bad_logits_are_rejected() {
        let mut s = Sampler::new(SamplingConfig::default(), 0).unwrap();
        let h = History::default();
        assert!(matches!(s.sample(&[], &h, &[], Some(0)), Err(Error::Shape(_))));
        let err = s.sample(&[0.0, f32::NAN], &h, &[], Some(0)).unwrap_err();
        assert_eq!(err, Error::Value("logits[1] is NaN; logits must be finite or -inf".into()));
        assert!(matches!(s.sample(&[f32::INFINITY], &h, &[], Some(0)), Err(Error::Value(_))));
        let err = s.sample(&[f32::NEG_INFINITY, 0.0], &h, &[1], Some(0)).unwrap_err();
        assert!(matches!(err, Error::Value(m) if m.starts_with("no token can be sampled")));
    }
}

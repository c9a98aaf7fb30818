//! How many drafts are worth their rows. A drafted token costs a row of the forward pass whether
//! it is kept or not; on a CPU a row past the first costs about half a one-row step (the batched
//! Q1 kernels are bound by arithmetic once rows share the weights' unpacking: 1.48x for two rows,
//! 2.89x for five, on the Bonsai-1.7B shapes with two threads of a Xeon; BENCHMARKS.md, session 41).
//! So a draft pays only when it is likely to be kept. Each request keeps a running estimate of how
//! often its drafts are kept ([`Acceptance`]), and a step drafts a request's `i`-th token only if
//! the chance of keeping it (the estimate to the `i`-th power: a draft is kept only after those
//! before it) beats what a row costs in tokens at this step ([`row_threshold`]).

/// A row past the first, in one-row steps: what a drafted token costs.
pub const ROW_COST: f32 = 0.5;

/// Kept drafts (`hits`) out of drafts tried (`trials`), recent ones weighing most, over a prior of
/// [`PRIOR_RATE`] worth [`PRIOR_TRIALS`] trials. A step where no draft pays still proposes one and
/// scores it against the token sampled (the scheduler's shadow draft), so the estimate follows the
/// request even while nothing is drafted: drafts resume when the output turns repetitive.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Acceptance {
    hits: f32,
    trials: f32,
}

pub const PRIOR_RATE: f32 = 0.7;
pub const PRIOR_TRIALS: f32 = 2.0;
/// What a step's evidence keeps of the evidence before it.
const KEEP_ON_EVIDENCE: f32 = 0.8;

impl Acceptance {
    /// The estimated chance that a draft is kept, given those before it were.
    pub fn rate(&self) -> f32 {
        (self.hits + PRIOR_RATE * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS)
    }

    /// Records a decode that drafted `drafted` tokens and kept the first `kept`: each kept draft is
    /// a hit, the first rejected one a miss; those after it were never tried.
    pub fn record(&mut self, drafted: usize, kept: usize) {
        let tried = kept + usize::from(kept < drafted);
        self.hits = self.hits * KEEP_ON_EVIDENCE + kept as f32;
        self.trials = self.trials * KEEP_ON_EVIDENCE + tried as f32;
    }
}

/// The chance of keeping a draft above which its row pays, in a step of `rows` rows of which
/// `decodes` sample tokens: adding a row costs [`ROW_COST`] of a one-row step, and the step yields a
/// token per decode for `1 + (rows - 1) * ROW_COST` of them. One decode alone: 0.5; 16 decodes:
/// 0.94 (a draft then costs about what another request's token does); a decode beside a long
/// prompt chunk: near 0.
pub fn row_threshold(decodes: usize, rows: usize) -> f32 {
    let step = 1.0 + rows.saturating_sub(1) as f32 * ROW_COST;
    (ROW_COST * decodes as f32 / step).min(1.0)
}

/// How many of up to `most` drafts pay at `rate` against `threshold`: the `i`-th pays while
/// `rate^i >= threshold`.
pub fn worth_drafting(rate: f32, threshold: f32, most: usize) -> usize {
    let (mut n, mut kept) = (0, rate);
    while n < most && kept >= threshold {
        n += 1;
        kept *= rate;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_that_are_kept_earn_more_drafts_and_rejected_ones_fewer() {
        let mut a = Acceptance::default();
        let lone = row_threshold(1, 1);
        assert_eq!(worth_drafting(a.rate(), lone, 8), 1, "the prior earns one draft alone");
        for _ in 0..10 {
            a.record(4, 4);
        }
        assert!(a.rate() > 0.95 && worth_drafting(a.rate(), lone, 8) == 8);
        for _ in 0..10 {
            a.record(2, 0);
        }
        assert!(a.rate() < lone && worth_drafting(a.rate(), lone, 8) == 0);
        for _ in 0..6 {
            a.record(1, 1); // shadow drafts that would have been kept
        }
        assert!(worth_drafting(a.rate(), lone, 8) >= 1, "drafting resumes");
    }

    #[test]
    fn a_row_pays_less_the_more_decodes_share_the_step() {
        assert_eq!(row_threshold(1, 1), ROW_COST);
        assert!(row_threshold(16, 16) > 0.9 && row_threshold(16, 16) < 1.0);
        assert!(row_threshold(1, 257) < 0.01, "beside a prompt chunk a row is cheap");
        assert_eq!(worth_drafting(0.999, row_threshold(64, 64), 4), 4);
        assert_eq!(worth_drafting(0.9, row_threshold(64, 64), 4), 0);
    }
}

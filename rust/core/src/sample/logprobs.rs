//! Raw logprobs (vLLM's default): the `log_softmax` of the logits exactly as the model produced them,
//! before penalties, temperature and filters. Computed stably: max-subtracted, with the sum of
//! exponentials accumulated in f64.

use super::math::{max_and_bad, sum_exp};
use super::rank::highest;

/// `log(sum(exp(logits)))`; `-inf` when every logit is `-inf`.
pub(crate) fn log_normalizer(logits: &[f32]) -> f64 {
    let max = max_and_bad(logits).0;
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    max as f64 + sum_exp(logits, max).ln()
}

/// The raw logprob of one token given the log-normalizer.
pub(crate) fn logprob(logits: &[f32], lse: f64, token: u32) -> f32 {
    (logits[token as usize] as f64 - lse) as f32
}

/// The `n` highest raw logprobs, descending, ties by ascending id; `ids` is scratch space.
pub(crate) fn top(logits: &[f32], lse: f64, n: usize, ids: &mut Vec<u32>) -> Vec<(u32, f32)> {
    highest(logits, n, ids);
    ids.iter().map(|&i| (i, logprob(logits, lse, i))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_normalizer_is_stable_for_huge_logits() {
        let lse = log_normalizer(&[1000.0, 1000.0, f32::NEG_INFINITY]);
        assert!((lse - (1000.0 + 2f64.ln())).abs() < 1e-9);
        assert_eq!(log_normalizer(&[f32::NEG_INFINITY; 2]), f64::NEG_INFINITY);
    }

    #[test]
    fn top_is_descending_with_ties_by_id() {
        let logits = [0.0, 2.0, 1.0, 2.0, f32::NEG_INFINITY];
        let lse = log_normalizer(&logits);
        let got = top(&logits, lse, 3, &mut Vec::new());
        let ids: Vec<u32> = got.iter().map(|p| p.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        assert_eq!(got[0].1, logprob(&logits, lse, 1));
        assert_eq!(top(&logits, lse, 99, &mut Vec::new()).len(), 5);
        assert!(top(&logits, lse, 0, &mut Vec::new()).is_empty());
    }
}

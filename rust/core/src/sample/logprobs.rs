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

/// How the model scored one given token: its raw logprob, its rank (1 + how many ids have a larger
/// logit, vLLM's rank), and the `n` highest raw logprobs. What a prompt token's logprobs are.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenScore {
    pub logprob: f32,
    pub rank: u32,
    pub top: Vec<(u32, f32)>,
}

/// Scores `token` under `logits` (one row, no NaN) with the `n` highest logprobs; `ids` is scratch.
pub fn score_token(logits: &[f32], token: u32, n: usize, ids: &mut Vec<u32>) -> TokenScore {
    let lse = log_normalizer(logits);
    let own = logits[token as usize];
    let rank = 1 + logits.iter().filter(|&&x| x > own).count() as u32;
    TokenScore { logprob: logprob(logits, lse, token), rank, top: top(logits, lse, n, ids) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_score_matches_a_float64_softmax() {
        let mut rng = crate::sample::Rng::new(0x5c07e ^ std::process::id() as u64);
        for _ in 0..50 {
            let vocab = 1 + (rng.next_u64() % 300) as usize;
            let logits: Vec<f32> = (0..vocab).map(|_| (rng.next_f64() * 40.0 - 20.0) as f32).collect();
            let token = (rng.next_u64() % vocab as u64) as u32;
            let n = (rng.next_u64() % 6) as usize;
            let got = score_token(&logits, token, n, &mut Vec::new());
            let lse = logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
            assert!((got.logprob as f64 - (logits[token as usize] as f64 - lse)).abs() < 1e-5);
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
            let first_equal = order.iter().position(|&i| logits[i as usize] == logits[token as usize]).unwrap();
            assert_eq!(got.rank as usize, first_equal + 1);
            let top_ids: Vec<u32> = got.top.iter().map(|p| p.0).collect();
            assert_eq!(top_ids, order[..n.min(vocab)]);
        }
    }

    #[test]
    fn tied_tokens_share_a_rank() {
        let logits = [1.0, 3.0, 3.0, 0.0];
        assert_eq!(score_token(&logits, 2, 0, &mut Vec::new()).rank, 1);
        assert_eq!(score_token(&logits, 0, 0, &mut Vec::new()).rank, 3);
        assert_eq!(
            score_token(&logits, 3, 1, &mut Vec::new()).top,
            vec![(1, score_token(&logits, 1, 0, &mut Vec::new()).logprob)]
        );
    }

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

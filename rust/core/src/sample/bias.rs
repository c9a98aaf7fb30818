//! Step 0 of the pipeline: a request's logit bias (OpenAI's `logit_bias`, vLLM's `SamplingParams.logit_bias`),
//! added to the raw logits of chosen tokens before the penalties, so -100 all but bans a token and +100
//! all but forces it. Logprobs stay those of the raw logits.

use crate::{Error, Result};

/// The largest bias magnitude (OpenAI's range, [-100, 100]).
pub const MAX_BIAS: f32 = 100.0;

/// Token ids and the amounts added to their logits, sorted by id, each id once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitBias {
    entries: Vec<(u32, f32)>,
}

impl LogitBias {
    /// Checks each amount (finite, within [`MAX_BIAS`]) and that no id repeats; token ids are checked
    /// against the vocabulary when the logits arrive ([`LogitBias::apply`]).
    pub fn new(mut entries: Vec<(u32, f32)>) -> Result<LogitBias> {
        let in_range = |b: f32| (-MAX_BIAS..=MAX_BIAS).contains(&b); // false for NaN
        if let Some(&(id, b)) = entries.iter().find(|&&(_, b)| !in_range(b)) {
            return Err(Error::Value(format!("logit_bias[{id}] must be in [-100, 100], got {b}")));
        }
        entries.sort_by_key(|&(id, _)| id);
        if let Some(pair) = entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::Value(format!("logit_bias names token {} twice", pair[0].0)));
        }
        Ok(LogitBias { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Adds each amount to its token's logit (a `-inf` logit stays `-inf`; a sum stays below
    /// `+inf`). Fails, changing nothing, if an id is outside a vocabulary of `logits.len()`.
    pub(crate) fn apply(&self, logits: &mut [f32]) -> Result<()> {
        let vocab = logits.len();
        if let Some(&(id, _)) = self.entries.iter().find(|&&(id, _)| id as usize >= vocab) {
            return Err(Error::Value(format!("logit_bias token {id} is not a token id of a vocabulary of {vocab}")));
        }
        for &(id, b) in &self.entries {
            let v = &mut logits[id as usize];
            *v = (*v + b).min(f32::MAX);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_to_the_named_logits_only() {
        let bias = LogitBias::new(vec![(3, -100.0), (0, 2.5)]).unwrap();
        let mut logits = [1.0, 1.0, f32::NEG_INFINITY, 7.0, f32::MAX];
        bias.apply(&mut logits).unwrap();
        assert_eq!(logits, [3.5, 1.0, f32::NEG_INFINITY, -93.0, f32::MAX]);
        let mut masked = [f32::NEG_INFINITY, f32::MAX, 0.0, 0.0];
        LogitBias::new(vec![(0, 100.0), (1, 100.0)]).unwrap().apply(&mut masked).unwrap();
        assert_eq!(masked, [f32::NEG_INFINITY, f32::MAX, 0.0, 0.0]);
    }

    #[test]
    fn bad_amounts_repeats_and_ids_are_refused() {
        for (entries, want) in [
            (vec![(1, 100.5)], "logit_bias[1] must be in [-100, 100], got 100.5"),
            (vec![(2, f32::NAN)], "logit_bias[2] must be in [-100, 100], got NaN"),
            (vec![(4, 1.0), (2, 0.0), (4, -1.0)], "logit_bias names token 4 twice"),
        ] {
            assert_eq!(LogitBias::new(entries).unwrap_err(), Error::Value(want.into()));
        }
        let bias = LogitBias::new(vec![(0, 1.0), (5, 1.0)]).unwrap();
        let mut logits = [0.0; 5];
        let err = bias.apply(&mut logits).unwrap_err();
        assert_eq!(err, Error::Value("logit_bias token 5 is not a token id of a vocabulary of 5".into()));
        assert_eq!(logits, [0.0; 5]);
    }
}

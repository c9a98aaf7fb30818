//! Steps 1-3 of the pipeline, in place on a scratch copy of the logits: the repetition penalty over
//! prompt and output tokens, frequency and presence penalties over output tokens, and banned ids.
//!
//! Counting uses `marks`, a per-thread array of vocabulary length that is all zero between calls:
//! each step touches only the history's entries and clears them again, so the cost is O(history),
//! never O(vocab) per history token.

use super::config::SamplingConfig;
use crate::{Error, Result};

/// The tokens a request has seen: its prompt and what it has generated so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct History<'a> {
    pub prompt: &'a [u32],
    pub output: &'a [u32],
}

impl<'a> History<'a> {
    pub fn new(prompt: &'a [u32], output: &'a [u32]) -> Self {
        History { prompt, output }
    }
}

/// Fails unless every id in `ids` is below `vocab`; the message names the list and the position.
pub(crate) fn check_ids(ids: &[u32], what: &str, vocab: usize) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab) {
        None => Ok(()),
        Some(i) => Err(Error::Value(format!("{what}[{i}] = {} is not a token id of a vocabulary of {vocab}", ids[i]))),
    }
}

/// Fails unless every prompt and output id is a token id of a vocabulary of `vocab`.
pub(crate) fn check_history(history: &History<'_>, vocab: usize) -> Result<()> {
    check_ids(history.prompt, "prompt", vocab)?;
    check_ids(history.output, "output", vocab)
}

/// Applies the penalties and bans to `logits`. `marks` must be all zero and at least as long as
/// `logits`; it is all zero again on return.
pub(crate) fn apply(
    logits: &mut [f32],
    history: &History<'_>,
    banned: &[u32],
    config: &SamplingConfig,
    marks: &mut [u32],
) -> Result<()> {
    let vocab = logits.len();
    check_history(history, vocab)?;
    check_ids(banned, "banned", vocab)?;
    if config.repetition_penalty != 1.0 {
        repetition(logits, history, config.repetition_penalty, marks);
    }
    if config.frequency_penalty != 0.0 || config.presence_penalty != 0.0 {
        frequency_presence(logits, history.output, config, marks);
    }
    for &id in banned {
        logits[id as usize] = f32::NEG_INFINITY;
    }
    Ok(())
}

/// Once per distinct token of prompt and output: `logit / p` if positive, else `logit * p`.
fn repetition(logits: &mut [f32], history: &History<'_>, penalty: f32, marks: &mut [u32]) {
    let seen = || history.prompt.iter().chain(history.output).map(|&id| id as usize);
    for id in seen() {
        if marks[id] == 0 {
            marks[id] = 1;
            let v = logits[id];
            logits[id] = saturate(if v > 0.0 { v / penalty } else { v * penalty });
        }
    }
    for id in seen() {
        marks[id] = 0;
    }
}

/// Once per distinct output token with `count` occurrences: `logit -= frequency * count + presence`.
fn frequency_presence(logits: &mut [f32], output: &[u32], config: &SamplingConfig, marks: &mut [u32]) {
    for &id in output {
        marks[id as usize] += 1;
    }
    for &id in output {
        let id = id as usize;
        let count = std::mem::take(&mut marks[id]);
        if count > 0 {
            let penalty = config.frequency_penalty * count as f32 + config.presence_penalty;
            logits[id] = saturate(logits[id] - penalty);
        }
    }
}

/// A penalized logit stays below `+inf` (a tiny repetition penalty could overflow it), so that the
/// later max-subtraction never meets `inf - inf`.
fn saturate(v: f32) -> f32 {
    v.min(f32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(logits: &[f32], prompt: &[u32], output: &[u32], banned: &[u32], config: SamplingConfig) -> Vec<f32> {
        let mut out = logits.to_vec();
        let mut marks = vec![0; logits.len()];
        apply(&mut out, &History::new(prompt, output), banned, &config, &mut marks).unwrap();
        assert!(marks.iter().all(|&m| m == 0), "marks must be clear after a call");
        out
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_once_per_token() {
        let config = SamplingConfig { repetition_penalty: 2.0, ..Default::default() };
        let got = run(&[4.0, -4.0, 0.0, 4.0, 1.0], &[0, 1, 0], &[2, 1, 1], &[], config);
        assert_eq!(got, [2.0, -8.0, 0.0, 4.0, 1.0]);
    }

    #[test]
    fn frequency_and_presence_count_output_tokens_only() {
        let config = SamplingConfig { frequency_penalty: 0.5, presence_penalty: 1.0, ..Default::default() };
        let got = run(&[1.0, 1.0, 1.0, 1.0], &[3, 3], &[0, 1, 0, 0], &[], config);
        assert_eq!(got, [1.0 - 1.5 - 1.0, 1.0 - 0.5 - 1.0, 1.0, 1.0]);
    }

    #[test]
    fn negative_penalties_raise_logits_and_bans_win() {
        let config = SamplingConfig { frequency_penalty: -1.0, presence_penalty: -2.0, ..Default::default() };
        let got = run(&[0.0, 0.0, 0.0], &[], &[1, 1, 2], &[2], config);
        assert_eq!(got, [0.0, 4.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn tiny_repetition_penalty_saturates_instead_of_overflowing() {
        let config = SamplingConfig { repetition_penalty: 1e-30, ..Default::default() };
        let got = run(&[1e10, f32::NEG_INFINITY], &[0, 1], &[], &[], config);
        assert_eq!(got, [f32::MAX, f32::NEG_INFINITY]);
    }

    #[test]
    fn out_of_range_ids_are_value_errors_naming_the_list() {
        let mut logits = vec![0.0; 4];
        let mut marks = vec![0; 4];
        let config = SamplingConfig::default();
        let err = apply(&mut logits, &History::new(&[0], &[1, 4]), &[], &config, &mut marks).unwrap_err();
        assert_eq!(err, Error::Value("output[1] = 4 is not a token id of a vocabulary of 4".into()));
        let err = apply(&mut logits, &History::default(), &[9], &config, &mut marks).unwrap_err();
        assert!(matches!(err, Error::Value(m) if m.starts_with("banned[0] = 9")));
    }
}

//! `SamplingConfig`: the knobs of one request's sampler and the ranges they must lie in. Validation
//! happens here, once, when a sampler is built; the pipeline trusts a validated config.

use crate::{Error, Result};

/// How one request turns logits into tokens (vLLM's parameters and meanings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingConfig {
    /// Divides the logits; 0 means greedy. Finite, >= 0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns the filter off.
    pub top_k: u32,
    /// Keep the smallest set of most likely tokens whose probability mass reaches `top_p`; in (0, 1].
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; in [0, 1].
    pub min_p: f32,
    /// Divides positive (multiplies non-positive) logits of tokens seen in prompt or output; > 0.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token present in the output; in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token in the output; in [-2, 2].
    pub frequency_penalty: f32,
}

impl Default for SamplingConfig {
    /// Plain sampling from the softmax of the logits: every knob off.
    fn default() -> Self {
        SamplingConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplingConfig {
    /// Greedy decoding (temperature 0), no penalties.
    pub fn greedy() -> Self {
        SamplingConfig { temperature: 0.0, ..Self::default() }
    }

    /// Checks every field; the error names the parameter, its allowed range and the given value.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        check("temperature", t, t.is_finite() && t >= 0.0, "a finite number >= 0")?;
        check("top_p", self.top_p, self.top_p > 0.0 && self.top_p <= 1.0, "in (0, 1]")?;
        check("min_p", self.min_p, (0.0..=1.0).contains(&self.min_p), "in [0, 1]")?;
        let rp = self.repetition_penalty;
        check("repetition_penalty", rp, rp.is_finite() && rp > 0.0, "a finite number > 0")?;
        let pp = self.presence_penalty;
        check("presence_penalty", pp, (-2.0..=2.0).contains(&pp), "in [-2, 2]")?;
        let fp = self.frequency_penalty;
        check("frequency_penalty", fp, (-2.0..=2.0).contains(&fp), "in [-2, 2]")
    }

    /// Whether sampling reduces to argmax (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Whether any penalty changes the logits before sampling.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

fn check(name: &str, value: f32, ok: bool, range: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Value(format!("{name} must be {range}, got {value}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(config: SamplingConfig) -> String {
        match config.validate() {
            Err(Error::Value(msg)) => msg,
            other => panic!("expected Error::Value, got {other:?}"),
        }
    }

    #[test]
    fn default_and_greedy_are_valid() {
        SamplingConfig::default().validate().unwrap();
        SamplingConfig::greedy().validate().unwrap();
        assert!(SamplingConfig::greedy().is_greedy());
        assert!(SamplingConfig { top_k: 1, ..Default::default() }.is_greedy());
        assert!(!SamplingConfig::default().is_greedy());
    }

    #[test]
    fn errors_name_parameter_range_and_value() {
        let d = SamplingConfig::default();
        let cases = [
            (SamplingConfig { temperature: -0.5, ..d }, "temperature must be a finite number >= 0, got -0.5"),
            (SamplingConfig { temperature: f32::INFINITY, ..d }, "temperature must be a finite number >= 0, got inf"),
            (SamplingConfig { top_p: 0.0, ..d }, "top_p must be in (0, 1], got 0"),
            (SamplingConfig { top_p: 1.5, ..d }, "top_p must be in (0, 1], got 1.5"),
            (SamplingConfig { min_p: f32::NAN, ..d }, "min_p must be in [0, 1], got NaN"),
            (SamplingConfig { repetition_penalty: 0.0, ..d }, "repetition_penalty must be a finite number > 0, got 0"),
            (SamplingConfig { presence_penalty: 2.5, ..d }, "presence_penalty must be in [-2, 2], got 2.5"),
            (SamplingConfig { frequency_penalty: -3.0, ..d }, "frequency_penalty must be in [-2, 2], got -3"),
        ];
        for (config, want) in cases {
            assert_eq!(message(config), want);
        }
    }
}

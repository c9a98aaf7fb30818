//! Rotary position embedding: its frequencies (plain, linear-scaled or YaRN-scaled; read from the
//! `qwen3.rope.scaling.*` GGUF keys by [`super::config`] or given by the caller) and the cos/sin table
//! of a batch's positions. YaRN follows Hugging Face's `rope_type: "yarn"` (which llama.cpp's
//! `rope_yarn` matches): per frequency pair a ramp between the interpolated angle (position / factor)
//! and the original, the ramp running between the pairs that turn `beta_fast` and `beta_slow` times
//! over the original context; cos and sin are multiplied by the attention factor.

use std::f64::consts::PI;

/// How the rotary frequencies are stretched past the context the model was trained on.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum RopeScaling {
    #[default]
    None,
    /// Every angle divided by `factor` (HF `"linear"`, llama.cpp `--rope-scaling linear`).
    Linear {
        factor: f64,
    },
    Yarn(Yarn),
}

/// YaRN's parameters (HF's names in the docs: `factor`, `original_max_position_embeddings`,
/// `beta_fast`, `beta_slow`, `attention_factor`).
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    /// The context the model was trained on.
    pub original_context: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// What cos and sin are multiplied by: HF's `attention_factor`, `0.1 ln(factor) + 1` by default.
    pub attention: f64,
}

impl Yarn {
    pub const DEFAULT_BETA_FAST: f64 = 32.0;
    pub const DEFAULT_BETA_SLOW: f64 = 1.0;

    /// HF's default attention factor for `factor`.
    pub fn default_attention(factor: f64) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * factor.ln() + 1.0
        }
    }

    /// The ramp's ends, as frequency-pair indices: where the original context holds `beta_fast`
    /// (`low`, floored) and `beta_slow` (`high`, ceiled) full turns, clamped to `0..=head_dim - 1`.
    fn correction_range(&self, head_dim: usize, base: f64) -> (f64, f64) {
        let dim = head_dim as f64;
        let at = |turns: f64| dim * (self.original_context as f64 / (turns * 2.0 * PI)).ln() / (2.0 * base.ln());
        (at(self.beta_fast).floor().max(0.0), at(self.beta_slow).ceil().min(dim - 1.0))
    }

    fn inv_freq(&self, head_dim: usize, base: f64) -> Vec<f64> {
        let (low, high) = self.correction_range(head_dim, base);
        let span = if high == low { 0.001 } else { high - low };
        plain_inv_freq(head_dim, base)
            .into_iter()
            .enumerate()
            .map(|(i, extrapolated)| {
                let interpolated = extrapolated / self.factor;
                let keep_original = 1.0 - ((i as f64 - low) / span).clamp(0.0, 1.0);
                interpolated * (1.0 - keep_original) + extrapolated * keep_original
            })
            .collect()
    }
}

impl RopeScaling {
    /// The longest sequence the scaled frequencies are meant for, given the file's context length:
    /// `factor` times the original context (vLLM's rule), never less than the file says.
    pub fn max_positions(&self, context_length: usize) -> usize {
        let stretched = match self {
            RopeScaling::None => context_length,
            RopeScaling::Linear { factor } => (context_length as f64 * factor) as usize,
            RopeScaling::Yarn(y) => (y.original_context as f64 * y.factor) as usize,
        };
        stretched.max(context_length)
    }

    /// Checks the parameters; the message names the offending one by its GGUF key's last part.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let check = |name: &str, value: f64, ok: bool| {
            if value.is_finite() && ok {
                Ok(())
            } else {
                Err(format!("rope.scaling.{name} is out of range: {value}"))
            }
        };
        match self {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => check("factor", *factor, *factor >= 1.0),
            RopeScaling::Yarn(y) => {
                check("factor", y.factor, y.factor >= 1.0)?;
                if y.original_context == 0 || y.original_context > 1 << 24 {
                    return Err(format!(
                        "rope.scaling.original_context_length is out of range: {}",
                        y.original_context
                    ));
                }
                check("yarn_beta_slow", y.beta_slow, y.beta_slow > 0.0)?;
                check("yarn_beta_fast", y.beta_fast, y.beta_fast > y.beta_slow)?;
                check("yarn_attn_factor", y.attention, y.attention > 0.0)
            }
        }
    }
}

/// A model's rotary frequencies: `head_dim / 2` inverse wavelengths and the cos/sin multiplier.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFrequencies {
    pub inv_freq: Vec<f64>,
    pub attention: f64,
}

impl RopeFrequencies {
    pub fn new(head_dim: usize, base: f64, scaling: &RopeScaling) -> RopeFrequencies {
        match scaling {
            RopeScaling::None => RopeFrequencies { inv_freq: plain_inv_freq(head_dim, base), attention: 1.0 },
            RopeScaling::Linear { factor } => RopeFrequencies {
                inv_freq: plain_inv_freq(head_dim, base).into_iter().map(|f| f / factor).collect(),
                attention: 1.0,
            },
            RopeScaling::Yarn(y) => RopeFrequencies { inv_freq: y.inv_freq(head_dim, base), attention: y.attention },
        }
    }

    /// The cos/sin table of `positions`, computed in f64.
    pub fn table(&self, positions: &[usize]) -> RopeTable {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for f in &self.inv_freq {
                let angle = p as f64 * f;
                cos.push((angle.cos() * self.attention) as f32);
                sin.push((angle.sin() * self.attention) as f32);
            }
        }
        RopeTable { half, cos, sin }
    }
}

/// `base^(-2i / head_dim)` for each pair `i`.
fn plain_inv_freq(head_dim: usize, base: f64) -> Vec<f64> {
    (0..head_dim / 2).map(|i| base.powf(-2.0 * i as f64 / head_dim as f64)).collect()
}

/// The cos/sin of every rotary frequency at every position of a batch: `head_dim / 2` pairs per token.
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Rotates one head vector of token `t` (rotate-half / NEOX layout: pairs `(i, i + half)`).
    pub fn rotate(&self, t: usize, head: &mut [f32]) {
        let (cos, sin) = (&self.cos[t * self.half..][..self.half], &self.sin[t * self.half..][..self.half]);
        let (lo, hi) = head.split_at_mut(self.half);
        for i in 0..self.half {
            let (x1, x2) = (lo[i], hi[i]);
            lo[i] = x1 * cos[i] - x2 * sin[i];
            hi[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(factor: f64, original_context: usize) -> Yarn {
        Yarn {
            factor,
            original_context,
            beta_fast: Yarn::DEFAULT_BETA_FAST,
            beta_slow: Yarn::DEFAULT_BETA_SLOW,
            attention: Yarn::default_attention(factor),
        }
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let table = RopeFrequencies::new(8, 10_000.0, &RopeScaling::None).table(&[0, 7]);
        let mut v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        table.rotate(0, &mut v);
        assert_eq!(v, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        let before: f32 = v.iter().map(|x| x * x).sum();
        table.rotate(1, &mut v);
        let after: f32 = v.iter().map(|x| x * x).sum();
        assert!((after - before).abs() < 1e-3);
    }

    #[test]
    fn yarn_keeps_fast_pairs_and_interpolates_slow_ones() {
        let (head_dim, base) = (128, 1e6);
        let plain = RopeFrequencies::new(head_dim, base, &RopeScaling::None).inv_freq;
        let y = yarn(4.0, 32_768);
        let (low, high) = y.correction_range(head_dim, base);
        assert!(0.0 < low && low < high && high < 63.0, "({low}, {high})");
        let scaled = RopeFrequencies::new(head_dim, base, &RopeScaling::Yarn(y)).inv_freq;
        for (i, (s, p)) in scaled.iter().zip(&plain).enumerate() {
            let i = i as f64;
            if i <= low {
                assert_eq!(s, p, "pair {i} turns fast: kept");
            } else if i >= high {
                assert!((s - p / 4.0).abs() <= 1e-15 * p, "pair {i} turns slowly: interpolated");
            } else {
                assert!(p / 4.0 < *s && s < p, "pair {i} is between");
            }
        }
    }

    #[test]
    fn linear_divides_every_angle_and_yarn_multiplies_cos_and_sin() {
        let linear = RopeFrequencies::new(16, 1e4, &RopeScaling::Linear { factor: 2.0 });
        let plain = RopeFrequencies::new(16, 1e4, &RopeScaling::None);
        assert!(linear.inv_freq.iter().zip(&plain.inv_freq).all(|(l, p)| *l == p / 2.0));
        let y = RopeFrequencies::new(16, 1e4, &RopeScaling::Yarn(yarn(4.0, 64)));
        let table = y.table(&[0]);
        let want = (0.1 * 4f64.ln() + 1.0) as f32;
        assert!(table.cos.iter().all(|c| *c == want) && table.sin.iter().all(|s| *s == 0.0));
    }

    #[test]
    fn max_positions_is_factor_times_the_original_context() {
        assert_eq!(RopeScaling::None.max_positions(40_960), 40_960);
        assert_eq!(RopeScaling::Yarn(yarn(4.0, 32_768)).max_positions(40_960), 131_072);
        assert_eq!(RopeScaling::Yarn(yarn(1.0, 32_768)).max_positions(40_960), 40_960);
        assert_eq!(RopeScaling::Linear { factor: 2.5 }.max_positions(1000), 2500);
    }

    #[test]
    fn out_of_range_parameters_are_named() {
        let bad = [
            (RopeScaling::Linear { factor: 0.5 }, "factor"),
            (RopeScaling::Yarn(Yarn { original_context: 0, ..yarn(4.0, 1) }), "original_context_length"),
            (RopeScaling::Yarn(Yarn { beta_fast: 0.5, ..yarn(4.0, 64) }), "yarn_beta_fast"),
            (RopeScaling::Yarn(Yarn { beta_slow: f64::NAN, ..yarn(4.0, 64) }), "yarn_beta_slow"),
            (RopeScaling::Yarn(Yarn { attention: 0.0, ..yarn(4.0, 64) }), "yarn_attn_factor"),
        ];
        for (scaling, name) in bad {
            let err = scaling.validate().unwrap_err();
            assert!(err.contains(name), "{err}");
        }
        assert_eq!(RopeScaling::Yarn(yarn(4.0, 32_768)).validate(), Ok(()));
    }
}

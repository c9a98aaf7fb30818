//! `Qwen3Config`: the hyper-parameters of a Qwen3 model, read from the `qwen3.*` GGUF keys (the only
//! place those key names appear) and checked for consistency before any tensor is bound.

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

use super::rope::{RopeFrequencies, RopeScaling, Yarn};

/// The shape and constants of a Qwen3 model.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3Config {
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Rows of the token embedding; set by the loader from `token_embd.weight`.
    pub vocab: usize,
    pub context_length: usize,
    pub rope_base: f64,
    pub rope_scaling: RopeScaling,
    pub rms_eps: f32,
}

const ARCH: &str = "qwen3";

impl Qwen3Config {
    /// Reads the config of a `general.architecture = qwen3` file (`vocab` is left 0 for the loader).
    pub fn from_gguf(file: &GgufFile) -> Result<Qwen3Config> {
        let arch = file.require_str("general.architecture")?;
        if arch != ARCH {
            return Err(Error::Gguf(format!(
                "unsupported architecture {arch:?} (general.architecture); oxibonsai runs 'qwen3' models"
            )));
        }
        let key = |name: &str| format!("{ARCH}.{name}");
        let n_heads = as_usize(file.require_u64(&key("attention.head_count"))?);
        let hidden = as_usize(file.require_u64(&key("embedding_length"))?);
        let default_head_dim = hidden.checked_div(n_heads).unwrap_or(0);
        let head_dim = file.get_u64(&key("attention.key_length"))?.map_or(default_head_dim, as_usize);
        if let Some(v) = file.get_u64(&key("attention.value_length"))? {
            if as_usize(v) != head_dim {
                return Err(Error::Gguf(format!(
                    "{ARCH}.attention.value_length ({v}) differs from the key length ({head_dim}); not supported"
                )));
            }
        }
        let config = Qwen3Config {
            n_layers: as_usize(file.require_u64(&key("block_count"))?),
            hidden,
            ffn: as_usize(file.require_u64(&key("feed_forward_length"))?),
            n_heads,
            n_kv_heads: file.get_u64(&key("attention.head_count_kv"))?.map_or(n_heads, as_usize),
            head_dim,
            vocab: 0,
            context_length: as_usize(file.require_u64(&key("context_length"))?),
            rope_base: file.get_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_scaling: rope_scaling_from_gguf(file)?,
            rms_eps: file.get_f64(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6) as f32,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks that the numbers describe a model this engine can run.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("block_count", self.n_layers),
            ("embedding_length", self.hidden),
            ("feed_forward_length", self.ffn),
            ("attention.head_count", self.n_heads),
            ("attention.head_count_kv", self.n_kv_heads),
            ("attention.key_length", self.head_dim),
            ("context_length", self.context_length),
        ];
        for (name, value) in positive {
            if value == 0 || value > MAX_DIM {
                return Err(Error::Gguf(format!("{ARCH}.{name} must be in 1..={MAX_DIM}, got {value}")));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(Error::Gguf(format!(
                "{ARCH}.attention.head_count ({}) must be a multiple of head_count_kv ({})",
                self.n_heads, self.n_kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(Error::Gguf(format!("{ARCH}.attention.key_length must be even, got {}", self.head_dim)));
        }
        if !(self.rope_base.is_finite() && self.rope_base > 1.0) {
            return Err(Error::Gguf(format!("{ARCH}.rope.freq_base must be finite and > 1, got {}", self.rope_base)));
        }
        self.rope_scaling.validate().map_err(|e| Error::Gguf(format!("{ARCH}.{e}")))?;
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(Error::Gguf(format!(
                "{ARCH}.attention.layer_norm_rms_epsilon must be finite and > 0, got {}",
                self.rms_eps
            )));
        }
        Ok(())
    }

    /// The longest sequence the model's positions are meant for: the context length, stretched by
    /// the rope scaling if there is one.
    pub fn max_positions(&self) -> usize {
        self.rope_scaling.max_positions(self.context_length)
    }

    /// The rotary frequencies of every attention head.
    pub fn rope(&self) -> RopeFrequencies {
        RopeFrequencies::new(self.head_dim, self.rope_base, &self.rope_scaling)
    }

    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// The `qwen3.rope.scaling.*` keys (llama.cpp's names): `type` none / linear / yarn, `factor`,
/// `original_context_length` (default: the context length), `yarn_beta_fast` / `_slow` (32 / 1) and
/// `yarn_attn_factor` (a multiplier of YaRN's default attention factor, 1); the legacy
/// `rope.scale_linear` where `type` is absent. Keys whose non-neutral values this engine does not
/// implement are refused rather than ignored. The result is validated.
pub fn rope_scaling_from_gguf(file: &GgufFile) -> Result<RopeScaling> {
    let key = |name: &str| format!("{ARCH}.rope.{name}");
    let neutral_values = [
        ("scaling.yarn_ext_factor", [-1.0, 1.0]),
        ("scaling.attn_factor", [1.0; 2]),
        ("scaling.yarn_log_multiplier", [0.0; 2]),
    ];
    for (name, neutral) in neutral_values {
        if let Some(v) = file.get_f64(&key(name))? {
            if !neutral.contains(&v) {
                return Err(Error::Gguf(format!("{} = {v} is not supported", key(name))));
            }
        }
    }
    let factor = || -> Result<f64> {
        file.get_f64(&key("scaling.factor"))?
            .ok_or_else(|| Error::Gguf(format!("{} is required by {}", key("scaling.factor"), key("scaling.type"))))
    };
    let scaling = match file.get_str(&key("scaling.type"))? {
        None => Ok(match file.get_f64(&key("scale_linear"))? {
            Some(factor) if factor != 1.0 => RopeScaling::Linear { factor },
            _ => RopeScaling::None,
        }),
        Some("none") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear { factor: factor()? }),
        Some("yarn") => {
            let factor = factor()?;
            let context = file.require_u64(&format!("{ARCH}.context_length"))?;
            let get = |name: &str, default: f64| Ok::<f64, Error>(file.get_f64(&key(name))?.unwrap_or(default));
            Ok(RopeScaling::Yarn(Yarn {
                factor,
                original_context: as_usize(file.get_u64(&key("scaling.original_context_length"))?.unwrap_or(context)),
                beta_fast: get("scaling.yarn_beta_fast", Yarn::DEFAULT_BETA_FAST)?,
                beta_slow: get("scaling.yarn_beta_slow", Yarn::DEFAULT_BETA_SLOW)?,
                attention: get("scaling.yarn_attn_factor", 1.0)? * Yarn::default_attention(factor),
            }))
        }
        Some(other) => Err(Error::Gguf(format!(
            "{} {other:?} is not supported; oxibonsai runs 'none', 'linear' and 'yarn'",
            key("scaling.type")
        ))),
    }?;
    scaling.validate().map_err(|e| Error::Gguf(format!("{ARCH}.{e}")))?;
    Ok(scaling)
}

/// Any single dimension beyond this is a corrupt file, not a model.
const MAX_DIM: usize = 1 << 24;

fn as_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

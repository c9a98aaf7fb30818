//! `Qwen3Config`: the hyper-parameters of a Qwen3 model, read from the `qwen3.*` GGUF keys (the only
//! place those key names appear) and checked for consistency before any tensor is bound.

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

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
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(Error::Gguf(format!(
                "{ARCH}.attention.layer_norm_rms_epsilon must be finite and > 0, got {}",
                self.rms_eps
            )));
        }
        Ok(())
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

/// Any single dimension beyond this is a corrupt file, not a model.
const MAX_DIM: usize = 1 << 24;

fn as_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

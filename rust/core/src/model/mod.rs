//! The Qwen3 model on the CPU: its config from GGUF metadata ([`config`]), its tensors bound by name
//! ([`weights`]), the element-wise ops ([`ops`]), rotary position embedding ([`rope`]), attention over the paged KV cache ([`attention`]),
//! the batched forward pass ([`forward`]) and the runner that pairs it with the cache's memory and
//! the [`SequenceTable`](crate::kv::SequenceTable) of sequences living in it ([`runner`]), and the
//! files its prefix cache is saved to and loaded from ([`cache_file`]).

pub mod attention;
pub mod cache_file;
pub mod config;
pub mod forward;
pub mod linear;
pub mod ops;
pub mod rope;
pub mod runner;
pub mod weights;

pub use config::Qwen3Config;
pub use forward::{Head, Qwen3Model, SeqChunk};
pub use linear::{Linear, MatmulPlan};
pub use rope::{RopeFrequencies, RopeScaling, Yarn};
pub use runner::{KvDtype, ModelRunner, DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_MODEL_LEN};
pub use weights::Qwen3Weights;

use crate::error::Result;
use crate::gguf::GgufFile;

impl Qwen3Model {
    /// Reads the config and binds every tensor of a `qwen3` GGUF file.
    pub fn from_gguf(file: &GgufFile, plan: MatmulPlan) -> Result<Qwen3Model> {
        let mut config = Qwen3Config::from_gguf(file)?;
        let weights = Qwen3Weights::load(file, &mut config)?;
        Ok(Qwen3Model { config, weights, plan, fingerprint: file.tensor_fingerprint() })
    }
}

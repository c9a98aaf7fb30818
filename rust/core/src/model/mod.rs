//! The Qwen3 model on the CPU: its config from GGUF metadata ([`config`]), its tensors bound by name
//! ([`weights`]), the element-wise ops ([`ops`]), attention over the paged KV cache ([`attention`]),
//! the batched forward pass ([`forward`]) the sequences and their KV blocks
//! ([`sequence_table`]) and the runner that pairs them with the cache's memory ([`runner`]).

pub mod attention;
pub mod config;
pub mod forward;
pub mod linear;
pub mod ops;
pub mod runner;
pub mod sequence;
mod sequence_slab;
pub mod sequence_table;
pub mod weights;

pub use config::Qwen3Config;
pub use forward::{Logits, Qwen3Model, SeqChunk};
pub use linear::{Linear, MatmulPlan};
pub use runner::{KvDtype, ModelRunner, StepItem, DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_MODEL_LEN};
pub use sequence_table::{blocks_for, SequenceTable, GENERATION_ROOM};
pub use weights::Qwen3Weights;

use crate::error::Result;
use crate::gguf::GgufFile;

impl Qwen3Model {
    /// Reads the config and binds every tensor of a `qwen3` GGUF file.
    pub fn from_gguf(file: &GgufFile, plan: MatmulPlan) -> Result<Qwen3Model> {
        let mut config = Qwen3Config::from_gguf(file)?;
        let weights = Qwen3Weights::load(file, &mut config)?;
        Ok(Qwen3Model { config, weights, plan })
    }
}

//! `Model`: a loaded Qwen3 GGUF model with its KV cache and sequences, for the Python engine.
//! Loading and every step release the GIL; logits come back as numpy arrays that own their buffer.

use std::path::PathBuf;
use std::sync::Mutex;

use numpy::PyArray2;
use oxibonsai_core::error::{Error, Result};
use oxibonsai_core::gguf::GgufFile;
use oxibonsai_core::model::{
    Head, KvDtype, MatmulPlan, ModelRunner, Qwen3Config, Qwen3Model, DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_MODEL_LEN,
};
use oxibonsai_core::pool;
use oxibonsai_core::q1::{Isa, Kernel};
use oxibonsai_core::step::{Logits, StepItem};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;
use crate::gil::without_gil;
use crate::logits;
use crate::prefix::stats_dict;
use crate::rope::{scaling_dict, RopeScalingArg};
use crate::token_ids::token_ids;

/// A Qwen3 model loaded from GGUF, its paged KV cache, and the sequences being generated.
#[pyclass(frozen, module = "oxibonsai._core")]
pub struct Model {
    runner: Mutex<ModelRunner>,
}

fn logits_mode(name: &str) -> PyResult<Logits> {
    match name {
        "none" => Ok(Logits::None),
        "last" => Ok(Logits::Last),
        "all" => Ok(Logits::All),
        _ => Err(PyValueError::new_err(format!("logits must be 'none', 'last' or 'all', got {name:?}"))),
    }
}

/// Replaces the file's rope base and scaling with the caller's.
fn override_rope(config: &mut Qwen3Config, scaling: Option<&RopeScalingArg>, theta: Option<f64>) -> Result<()> {
    if let Some(theta) = theta {
        if !(theta.is_finite() && theta > 1.0) {
            return Err(Error::Value(format!("rope_theta must be finite and > 1, got {theta}")));
        }
        config.rope_base = theta;
    }
    if let Some(scaling) = scaling {
        config.rope_scaling = scaling.to_core(config.context_length)?;
    }
    Ok(())
}

impl Model {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, ModelRunner> {
        self.runner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn run<'py>(
        &self,
        py: Python<'py>,
        items: Vec<(u64, Vec<u32>, String)>,
        head: Head,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let modes = items.iter().map(|(_, _, m)| logits_mode(m)).collect::<PyResult<Vec<_>>>()?;
        let (rows, width) = without_gil(py, || {
            let step: Vec<StepItem> = items
                .iter()
                .zip(&modes)
                .map(|((seq, tokens, _), &logits)| StepItem::new(*seq, tokens, logits))
                .collect();
            let mut runner = self.lock();
            let config = &runner.model().config;
            let width = if head == Head::Hidden { config.hidden } else { config.vocab };
            let mut rows = logits::buffer();
            let done = match head {
                Head::Logits => runner.step_into(&step, &pool::global(), &mut rows),
                Head::Hidden => runner.hidden_into(&step, &pool::global(), &mut rows),
            };
            done.map(|()| (rows, width))
        })
        .map_err(to_py)?;
        logits::into_array(py, rows, width)
    }
}

#[pymethods]
impl Model {
    /// Loads `path`. `max_model_len` defaults to the model's context length, at most 4096. The KV
    /// cache holds `kv_blocks` 16-token blocks; by default enough for `max_num_seqs` full sequences
    /// within `kv_cache_bytes` (2 GiB), never fewer than one sequence needs. `kv_cache_dtype` is
    /// 'f16' ('auto'), 'f32' or 'int8'. `enable_prefix_caching`: sequences started with `add_sequence_cached`
    /// reuse cached full blocks of their prompt, and cache the blocks they fill. `rope_scaling` (an
    /// `oxibonsai.RopeScaling`) and `rope_theta` replace the file's; a scaling stretches the longest
    /// `max_model_len` to its factor times the original context.
    #[new]
    #[pyo3(signature = (
        path, *, max_model_len=None, kv_blocks=None, kv_cache_bytes=None, max_num_seqs=1, kernel="auto",
        kv_cache_dtype="auto", enable_prefix_caching=true, rope_scaling=None, rope_theta=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        max_model_len: Option<usize>,
        kv_blocks: Option<usize>,
        kv_cache_bytes: Option<usize>,
        max_num_seqs: usize,
        kernel: &str,
        kv_cache_dtype: &str,
        enable_prefix_caching: bool,
        rope_scaling: Option<RopeScalingArg>,
        rope_theta: Option<f64>,
    ) -> PyResult<Model> {
        let plan = MatmulPlan { kernel: Kernel::parse(kernel).map_err(to_py)?, isa: Isa::detect() };
        let dtype = KvDtype::parse(kv_cache_dtype).map_err(to_py)?;
        let runner = without_gil(py, || {
            let file = GgufFile::open(&path)?;
            let mut model = Qwen3Model::from_gguf(&file, plan)?;
            override_rope(&mut model.config, rope_scaling.as_ref(), rope_theta)?;
            let len = max_model_len.unwrap_or(model.config.max_positions().min(DEFAULT_MAX_MODEL_LEN));
            let block_bytes = dtype.block_bytes(model.kv_layout());
            let budget = kv_cache_bytes.unwrap_or(DEFAULT_KV_CACHE_BYTES);
            let blocks =
                kv_blocks.unwrap_or_else(|| ModelRunner::default_blocks(len, block_bytes, max_num_seqs, budget));
            let mut runner = ModelRunner::new(model, blocks, len, dtype)?;
            runner.table_mut().set_prefix_caching(enable_prefix_caching);
            Ok(runner)
        })
        .map_err(to_py)?;
        Ok(Model { runner: Mutex::new(runner) })
    }

    /// The model's hyper-parameters.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let runner = self.lock();
        let c = &runner.model().config;
        let d = PyDict::new(py);
        d.set_item("n_layers", c.n_layers)?;
        d.set_item("hidden", c.hidden)?;
        d.set_item("ffn", c.ffn)?;
        d.set_item("n_heads", c.n_heads)?;
        d.set_item("n_kv_heads", c.n_kv_heads)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("vocab", c.vocab)?;
        d.set_item("context_length", c.context_length)?;
        d.set_item("rope_base", c.rope_base)?;
        d.set_item("rope_scaling", scaling_dict(py, &c.rope_scaling)?)?;
        d.set_item("max_positions", c.max_positions())?;
        d.set_item("rms_eps", c.rms_eps)?;
        d.set_item("tied_output", runner.model().weights.output.is_none())?;
        d.set_item("kv_cache_dtype", runner.kv_dtype().name())?;
        Ok(d)
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.lock().model().config.vocab
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.lock().max_model_len()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.lock().table().num_blocks()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.lock().table().num_free_blocks()
    }

    #[getter]
    fn num_sequences(&self) -> usize {
        self.lock().table().num_sequences()
    }

    /// Tokens per KV block.
    #[getter]
    fn block_tokens(&self) -> usize {
        oxibonsai_core::kv::BLOCK_TOKENS
    }

    /// Bytes of keys and values per KV block (all layers).
    #[getter]
    fn block_bytes(&self) -> usize {
        self.lock().block_bytes()
    }

    /// Free blocks plus cached blocks no sequence uses (evicted when a step needs them).
    #[getter]
    fn num_available_blocks(&self) -> usize {
        self.lock().table().num_available_blocks()
    }

    #[getter]
    fn prefix_caching(&self) -> bool {
        self.lock().table().prefix_caching()
    }

    /// Starts an empty sequence; returns its id. Its blocks are not cached.
    fn add_sequence(&self) -> u64 {
        self.lock().table_mut().add_sequence()
    }

    /// `(cached tokens, idle blocks)`: the cached prefix `add_sequence_cached` would start this prompt
    /// on, and how many of its blocks no sequence holds yet. Changes nothing.
    #[pyo3(signature = (prompt, salt=None))]
    fn cached_prefix(&self, prompt: &Bound<'_, PyAny>, salt: Option<&str>) -> PyResult<(usize, usize)> {
        let prompt = token_ids(prompt)?;
        let m = self.lock().table().cached_prefix(&prompt, salt);
        Ok((m.cached_tokens, m.idle_blocks))
    }

    /// Starts a sequence on the longest cached prefix of `prompt` (at most all but its last token);
    /// returns `(sequence id, cached tokens)`. Step `prompt[cached:]` next.
    #[pyo3(signature = (prompt, salt=None))]
    fn add_sequence_cached(&self, prompt: &Bound<'_, PyAny>, salt: Option<&str>) -> PyResult<(u64, usize)> {
        let prompt = token_ids(prompt)?;
        Ok(self.lock().table_mut().add_sequence_cached(&prompt, salt))
    }

    /// Prefix-cache statistics, plus `computed_tokens` (tokens run through the model so far).
    fn cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let runner = self.lock();
        let d = stats_dict(py, &runner.table().cache_stats())?;
        d.set_item("computed_tokens", runner.computed_tokens())?;
        Ok(d)
    }

    /// Writes every cached block (chains, tokens, salts, KV) to `path`, atomically; returns how many.
    fn save_prefix_cache(&self, py: Python<'_>, path: PathBuf) -> PyResult<usize> {
        without_gil(py, || self.lock().save_prefix_cache(&path)).map_err(to_py)
    }

    /// Caches the blocks of a file `save_prefix_cache` wrote for this model and settings, in free
    /// blocks; returns how many are cached.
    fn load_prefix_cache(&self, py: Python<'_>, path: PathBuf) -> PyResult<usize> {
        without_gil(py, || self.lock().load_prefix_cache(&path)).map_err(to_py)
    }

    /// Drops every cached block no sequence uses; returns how many.
    fn reset_prefix_cache(&self) -> usize {
        self.lock().table_mut().reset_prefix_cache()
    }

    /// A new sequence holding the KV of sequence `seq` (its cached blocks shared, the rest copied).
    fn fork_sequence(&self, seq: u64) -> PyResult<u64> {
        self.lock().fork_sequence(seq).map_err(to_py)
    }

    /// Ends a sequence and frees its KV blocks.
    fn free_sequence(&self, seq: u64) -> PyResult<()> {
        self.lock().table_mut().free_sequence(seq).map_err(to_py)
    }

    /// Tokens of KV a sequence holds.
    fn sequence_len(&self, seq: u64) -> PyResult<usize> {
        self.lock().table().sequence_len(seq).map_err(to_py)
    }

    /// Runs one batched forward pass. Each item is `(sequence id, token ids, logits)` with logits
    /// `'none'`, `'last'` or `'all'`; returns float32 `(rows, vocab)` for the requested rows in order.
    fn step<'py>(&self, py: Python<'py>, items: Vec<(u64, Vec<u32>, String)>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        self.run(py, items, Head::Logits)
    }

    /// ``step``, returning for the rows each item wants the final RMS-normed hidden states
    /// (``rows x hidden``: what the LM head reads, and what an embedding is pooled from).
    fn hidden_states<'py>(
        &self,
        py: Python<'py>,
        items: Vec<(u64, Vec<u32>, String)>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        self.run(py, items, Head::Hidden)
    }
}

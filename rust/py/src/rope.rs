//! Rope scaling across the boundary: Python's `oxibonsai.RopeScaling` (Hugging Face's `rope_scaling`
//! names, read by attribute) in, the core's frequencies and a GGUF file's scaling (as the same
//! names, a dict) out.

use numpy::PyArray1;
use oxibonsai_core::error::{Error, Result};
use oxibonsai_core::model::config::rope_scaling_from_gguf;
use oxibonsai_core::model::{RopeFrequencies, RopeScaling, Yarn};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;
use crate::gguf::GgufFile;

/// The fields of a Python `RopeScaling` (validated there).
#[derive(FromPyObject)]
pub struct RopeScalingArg {
    #[pyo3(attribute)]
    rope_type: String,
    #[pyo3(attribute)]
    factor: f64,
    #[pyo3(attribute)]
    original_max_position_embeddings: Option<usize>,
    #[pyo3(attribute)]
    beta_fast: f64,
    #[pyo3(attribute)]
    beta_slow: f64,
    #[pyo3(attribute)]
    attention_factor: Option<f64>,
}

impl RopeScalingArg {
    /// The core's scaling; YaRN's original context defaults to `context_length`.
    pub fn to_core(&self, context_length: usize) -> Result<RopeScaling> {
        let scaling = match self.rope_type.as_str() {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: self.factor },
            "yarn" => RopeScaling::Yarn(Yarn {
                factor: self.factor,
                original_context: self.original_max_position_embeddings.unwrap_or(context_length),
                beta_fast: self.beta_fast,
                beta_slow: self.beta_slow,
                attention: self.attention_factor.unwrap_or_else(|| Yarn::default_attention(self.factor)),
            }),
            other => return Err(Error::Value(format!("rope_type {other:?} is not supported"))),
        };
        scaling.validate().map_err(Error::Value)?;
        Ok(scaling)
    }
}

/// `scaling` with Hugging Face's names (`rope_type`, `factor`, ...), or None when there is none.
pub fn scaling_dict<'py>(py: Python<'py>, scaling: &RopeScaling) -> PyResult<Option<Bound<'py, PyDict>>> {
    let d = PyDict::new(py);
    match scaling {
        RopeScaling::None => return Ok(None),
        RopeScaling::Linear { factor } => {
            d.set_item("rope_type", "linear")?;
            d.set_item("factor", factor)?;
        }
        RopeScaling::Yarn(y) => {
            d.set_item("rope_type", "yarn")?;
            d.set_item("factor", y.factor)?;
            d.set_item("original_max_position_embeddings", y.original_context)?;
            d.set_item("beta_fast", y.beta_fast)?;
            d.set_item("beta_slow", y.beta_slow)?;
            d.set_item("attention_factor", y.attention)?;
        }
    }
    Ok(Some(d))
}

/// The `qwen3.rope.scaling.*` keys of `file`, read and checked as the native loader does.
#[pyfunction]
pub fn gguf_rope_scaling<'py>(py: Python<'py>, file: &GgufFile) -> PyResult<Option<Bound<'py, PyDict>>> {
    scaling_dict(py, &rope_scaling_from_gguf(&file.inner).map_err(to_py)?)
}

/// The rotary frequencies of a head: float64 `[head_dim / 2]` inverse wavelengths and the factor
/// cos and sin are multiplied by.
#[pyfunction]
#[pyo3(signature = (head_dim, base, scaling=None, context_length=0))]
pub fn rope_frequencies<'py>(
    py: Python<'py>,
    head_dim: usize,
    base: f64,
    scaling: Option<RopeScalingArg>,
    context_length: usize,
) -> PyResult<(Bound<'py, PyArray1<f64>>, f64)> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) || !(base.is_finite() && base > 1.0) {
        return Err(PyValueError::new_err(format!(
            "head_dim must be even and positive and base finite and > 1, got {head_dim} and {base}"
        )));
    }
    let scaling = scaling.map_or(Ok(RopeScaling::None), |s| s.to_core(context_length)).map_err(to_py)?;
    let f = RopeFrequencies::new(head_dim, base, &scaling);
    Ok((PyArray1::from_vec(py, f.inv_freq), f.attention))
}

//! `Sampler`: one request's seeded sampler (logit bias, penalties, temperature, top-k/p, min-p), for Python.
//! The engine samples in Rust directly; this class exposes the same code to tests and tools.

use numpy::{PyArray1, PyArrayMethods};
use oxibonsai_core::sample::{History, LogitBias, Sampler as CoreSampler, SamplingConfig, TokenMask};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::arrays::f32_array;
use crate::errors::to_py;
use crate::gil::without_gil;

/// A token sampler with its own random stream: the same seed, logits and history give the same token.
#[pyclass(module = "oxibonsai")]
pub struct Sampler {
    pub(crate) inner: CoreSampler,
}

/// One `sample` result: the token, its raw logprob, and the top raw logprobs.
pub(crate) type SampleResult = (u32, Option<f32>, Vec<(u32, f32)>);

/// A logprob count (`None`: no logprobs at all); a negative one is a ValueError.
pub(crate) fn logprob_count(n: Option<i64>) -> PyResult<Option<usize>> {
    n.map(|n| usize::try_from(n).map_err(|_| PyValueError::new_err(format!("logprobs must be >= 0, got {n}"))))
        .transpose()
}

/// Token ids from a sequence of ints (`None`: none); errors name the argument and the position.
pub(crate) fn token_ids(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Vec<u32>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(Vec::new()) };
    let ids: Vec<i64> = obj.extract().map_err(|e| {
        let ty = obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
        PyTypeError::new_err(format!("{name} must be a sequence of int token ids, got {ty} ({e})"))
    })?;
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id).map_err(|_| PyValueError::new_err(format!("{name}[{i}] = {id} is not a valid token id")))
        })
        .collect()
}

/// A structured-output allow-bitmask (`None`: every id allowed): a 1-D int32 or uint32 array, bit
/// `i % 32` of word `i / 32` set where id `i` is allowed (what llguidance fills).
pub(crate) fn mask_words(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u32>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(None) };
    let wrong = || PyTypeError::new_err("allowed must be a 1-D numpy array of int32 or uint32 bitmask words");
    if let Ok(words) = obj.cast::<PyArray1<u32>>() {
        return Ok(Some(words.to_vec().map_err(|_| wrong())?));
    }
    let words = obj.cast::<PyArray1<i32>>().map_err(|_| wrong())?;
    let words = words.readonly();
    let words = words.as_array();
    Ok(Some(words.iter().map(|&w| w as u32).collect()))
}

/// The owned inputs of one sampling call, extracted (and checked) before the GIL is released.
struct Inputs<'py> {
    logits: numpy::PyReadonlyArrayDyn<'py, f32>,
    prompt: Vec<u32>,
    output: Vec<u32>,
    banned: Vec<u32>,
    allowed: Option<Vec<u32>>,
}

impl<'py> Inputs<'py> {
    fn extract(
        logits: &Bound<'py, PyAny>,
        prompt_ids: &Bound<'py, PyAny>,
        output_ids: &Bound<'py, PyAny>,
        banned: Option<&Bound<'py, PyAny>>,
        allowed: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Inputs<'py>> {
        Ok(Inputs {
            logits: f32_array(logits, "logits", &[1])?,
            prompt: token_ids(Some(prompt_ids), "prompt_ids")?,
            output: token_ids(Some(output_ids), "output_ids")?,
            banned: token_ids(banned, "banned")?,
            allowed: mask_words(allowed)?,
        })
    }

    fn mask(&self) -> Option<TokenMask<'_>> {
        self.allowed.as_deref().map(TokenMask::new)
    }

    fn logits(&self) -> PyResult<&[f32]> {
        self.logits.as_slice().map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn history(&self) -> History<'_> {
        History::new(&self.prompt, &self.output)
    }
}

#[pymethods]
impl Sampler {
    #[new]
    #[pyo3(signature = (temperature = 1.0, top_k = 0, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0,
                        presence_penalty = 0.0, frequency_penalty = 0.0, seed = 0, logit_bias = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        temperature: f32,
        top_k: u32,
        top_p: f32,
        min_p: f32,
        repetition_penalty: f32,
        presence_penalty: f32,
        frequency_penalty: f32,
        seed: u64,
        logit_bias: Option<Vec<(u32, f32)>>,
    ) -> PyResult<Sampler> {
        let config = SamplingConfig {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
        };
        let bias = LogitBias::new(logit_bias.unwrap_or_default()).map_err(to_py)?;
        Ok(Sampler { inner: CoreSampler::new(config, seed).map_err(to_py)?.with_bias(bias) })
    }

    /// Samples one token: `(token, raw logprob, [(id, raw logprob)] * logprobs, descending)`;
    /// `logprobs=None` computes no logprob (`(token, None, [])`), which is most of a greedy draw's cost.
    /// `allowed`: a structured-output allow-bitmask (int32 words, one bit per id), or None.
    #[pyo3(
        signature = (logits, prompt_ids, output_ids, banned = None, logprobs = Some(0), allowed = None),
        text_signature = "(self, /, logits, prompt_ids, output_ids, banned=None, logprobs=0, allowed=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn sample(
        &mut self,
        py: Python<'_>,
        logits: &Bound<'_, PyAny>,
        prompt_ids: &Bound<'_, PyAny>,
        output_ids: &Bound<'_, PyAny>,
        banned: Option<&Bound<'_, PyAny>>,
        logprobs: Option<i64>,
        allowed: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<SampleResult> {
        let logprobs = logprob_count(logprobs)?;
        let args = Inputs::extract(logits, prompt_ids, output_ids, banned, allowed)?;
        let (logits, history, mask) = (args.logits()?, args.history(), args.mask());
        let inner = &mut self.inner;
        let sampled =
            without_gil(py, || inner.sample_masked(logits, &history, &args.banned, mask, logprobs)).map_err(to_py)?;
        Ok((sampled.token, sampled.logprob, sampled.top))
    }

    /// The float32 distribution `sample` draws from (zero outside the candidates; one-hot if greedy).
    #[pyo3(signature = (logits, prompt_ids, output_ids, banned = None, allowed = None))]
    fn probabilities<'py>(
        &self,
        py: Python<'py>,
        logits: &Bound<'py, PyAny>,
        prompt_ids: &Bound<'py, PyAny>,
        output_ids: &Bound<'py, PyAny>,
        banned: Option<&Bound<'py, PyAny>>,
        allowed: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let args = Inputs::extract(logits, prompt_ids, output_ids, banned, allowed)?;
        let (logits, history, mask) = (args.logits()?, args.history(), args.mask());
        let inner = &self.inner;
        let probs =
            without_gil(py, || inner.probabilities_masked(logits, &history, &args.banned, mask)).map_err(to_py)?;
        Ok(PyArray1::from_vec(py, probs))
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Sampler(temperature={}, top_k={}, top_p={}, min_p={}, repetition_penalty={}, \
             presence_penalty={}, frequency_penalty={})",
            c.temperature, c.top_k, c.top_p, c.min_p, c.repetition_penalty, c.presence_penalty, c.frequency_penalty
        )
    }
}

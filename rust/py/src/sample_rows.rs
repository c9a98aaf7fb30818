//! `sample_rows`: a step's draws, one per row of its logits, each by its own request's `Sampler`,
//! the rows in parallel on the kernels' pool. From Python a row at a time the draws were serial
//! (~0.25 ms a row at a 152k vocabulary, on one core however many the step's matmuls had used).
//! Each row's draw is exactly what `Sampler.sample` gives with the same arguments.

use std::sync::Mutex;

use numpy::PyUntypedArrayMethods;
use oxibonsai_core::pool;
use oxibonsai_core::sample::{History, Sampled, Sampler as CoreSampler, TokenMask};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::f32_array;
use crate::errors::to_py;
use crate::gil::without_gil;
use crate::sample::{logprob_count, mask_words, token_ids, SampleResult, Sampler};

/// A row's sampler and, once drawn, its draw.
type RowCell<'a> = Mutex<(&'a mut CoreSampler, Option<oxibonsai_core::Result<Sampled>>)>;

/// One row's owned inputs, extracted before the GIL is released.
struct Row {
    prompt: Vec<u32>,
    output: Vec<u32>,
    banned: Vec<u32>,
    allowed: Option<Vec<u32>>,
    logprobs: Option<usize>,
}

/// Samples row `i` of the 2-D float32 `logits` with `samplers[i]`, given that row's prompt and output
/// ids, banned ids (or None), logprob count (or None) and allow-bitmask (or None), as
/// `Sampler.sample` takes them (the ids are read only for a sampler with penalties); the first row's
/// error, if any, is raised once every row has drawn.
#[pyfunction]
#[pyo3(signature = (samplers, logits, prompt_ids, output_ids, banned, logprobs, allowed))]
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(
    py: Python<'_>,
    samplers: Vec<Bound<'_, Sampler>>,
    logits: &Bound<'_, PyAny>,
    prompt_ids: Vec<Bound<'_, PyAny>>,
    output_ids: Vec<Bound<'_, PyAny>>,
    banned: Vec<Option<Bound<'_, PyAny>>>,
    logprobs: Vec<Option<i64>>,
    allowed: Vec<Option<Bound<'_, PyAny>>>,
) -> PyResult<Vec<SampleResult>> {
    let logits = f32_array(logits, "logits", &[2])?;
    let (n, vocab) = (logits.shape()[0], logits.shape()[1]);
    let lengths = [samplers.len(), prompt_ids.len(), output_ids.len(), banned.len(), logprobs.len(), allowed.len()];
    if lengths.iter().any(|&len| len != n) {
        return Err(PyValueError::new_err(format!(
            "sample_rows needs one sampler, prompt_ids, output_ids, banned, logprobs and allowed per \
             logits row ({n} rows), got {lengths:?}"
        )));
    }
    let mut guards = samplers.iter().map(|s| s.try_borrow_mut()).collect::<Result<Vec<_>, _>>()?;
    // The prompt and output ids only feed the penalties: a sampler without them is not handed the
    // (O(prompt length)) conversion every token.
    let rows = (0..n)
        .map(|i| {
            let penalized = guards[i].inner.config().has_penalties();
            let history =
                |ids: &Bound<'_, PyAny>, name| if penalized { token_ids(Some(ids), name) } else { Ok(Vec::new()) };
            Ok(Row {
                prompt: history(&prompt_ids[i], "prompt_ids")?,
                output: history(&output_ids[i], "output_ids")?,
                banned: token_ids(banned[i].as_ref(), "banned")?,
                allowed: mask_words(allowed[i].as_ref())?,
                logprobs: logprob_count(logprobs[i])?,
            })
        })
        .collect::<PyResult<Vec<Row>>>()?;
    let cells: Vec<RowCell> = guards.iter_mut().map(|g| Mutex::new((&mut g.inner, None))).collect();
    let all = logits.as_slice().map_err(|e| PyValueError::new_err(e.to_string()))?;
    without_gil(py, || {
        pool::global().run(n, &|i| {
            let row = &rows[i];
            let history = History::new(&row.prompt, &row.output);
            let mask = row.allowed.as_deref().map(TokenMask::new);
            let mut cell = cells[i].lock().unwrap_or_else(|e| e.into_inner());
            let drawn =
                cell.0.sample_masked(&all[i * vocab..(i + 1) * vocab], &history, &row.banned, mask, row.logprobs);
            cell.1 = Some(drawn);
        })
    });
    cells
        .into_iter()
        .map(|cell| {
            let (_, drawn) = cell.into_inner().unwrap_or_else(|e| e.into_inner());
            let s = drawn.expect("every row was drawn").map_err(to_py)?;
            Ok((s.token, s.logprob, s.top))
        })
        .collect()
}

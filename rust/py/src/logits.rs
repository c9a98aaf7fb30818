//! Step logits handed to Python in memory that is reused from step to step. A step's logits are ~0.6
//! MB a row for a 151,936-token vocabulary; glibc maps an allocation above its mmap threshold (32 MiB
//! at most, ~54 such rows) afresh every time, and the kernel then faults in and zeroes every page of
//! it: ~3% of a 64-row decode step on the 2-core Zen 4 VM. Here each array's memory belongs to a
//! [`StepLogits`] object, the array's base; when Python frees the array, the buffer goes back to a
//! small pool and the next step writes its logits there. A buffer returns only after the array over
//! it is gone, so no array ever changes under its holder.

use std::sync::{Mutex, MutexGuard, PoisonError};

use numpy::ndarray::ArrayView2;
use numpy::PyArray2;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Spare buffers kept: an engine frees a step's logits before its next step, so one circulates; the
/// second covers a caller that holds one step's array into the next.
const KEEP: usize = 2;

/// Buffers larger than this are freed, not kept: decode steps of up to ~440 rows fit, while the
/// every-position logits of a long prompt (`LLM.logits`, 2.5 GB at 4,096 tokens) do not stay
/// resident after their array is gone.
const KEEP_BYTES: usize = 256 << 20;

static SPARE: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

fn spare() -> MutexGuard<'static, Vec<Vec<f32>>> {
    SPARE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A buffer for the next step's logits: the largest spare one, or a new, empty one.
pub fn buffer() -> Vec<f32> {
    let mut spare = spare();
    let largest = (0..spare.len()).max_by_key(|&i| spare[i].capacity());
    largest.map(|i| spare.swap_remove(i)).unwrap_or_default()
}

/// The owner of one step's logits array: holds the buffer while the array lives, then gives it back.
#[pyclass(frozen, module = "oxibonsai._core")]
pub struct StepLogits {
    data: Vec<f32>,
}

impl Drop for StepLogits {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.data);
        if buf.capacity() * size_of::<f32>() > KEEP_BYTES {
            return;
        }
        let mut spare = spare();
        if spare.len() < KEEP {
            spare.push(buf);
        }
    }
}

/// `logits` (rows of `vocab` values, one after another) as a float32 `(rows, vocab)` array whose
/// memory goes back to the pool when Python frees it.
pub fn into_array(py: Python<'_>, logits: Vec<f32>, vocab: usize) -> PyResult<Bound<'_, PyArray2<f32>>> {
    let rows = logits.len().checked_div(vocab).unwrap_or(0);
    let owner = Bound::new(py, StepLogits { data: logits })?;
    let view = ArrayView2::from_shape((rows, vocab), &owner.get().data[..rows * vocab])
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    // SAFETY: the array's memory is `owner`'s, and `owner` is the array's base object, so it outlives
    // the array. `owner` is frozen: nothing reallocates or touches the buffer until it is dropped,
    // after the array, when the buffer moves (not its contents) to the pool.
    Ok(unsafe { PyArray2::borrow_from_array(&view, owner.clone().into_any()) })
}

//! `StepPlan`: one step's attention metadata for a runner outside Rust, as numpy arrays that own
//! their memory (moved from the core's vectors, never copied).

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use oxibonsai_core::step::StepPlan as CorePlan;
use pyo3::prelude::*;

/// What one step computes and where its KV goes (see `Scheduler.prepare`).
#[pyclass(frozen, module = "oxibonsai._core")]
pub struct StepPlan {
    #[pyo3(get)]
    input_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i32>>,
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_tables: Py<PyArray2<i32>>,
    #[pyo3(get)]
    logits_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    decode_from: Py<PyArray1<i32>>,
    #[pyo3(get)]
    demote: Py<PyArray2<i32>>,
    #[pyo3(get)]
    promote: Py<PyArray2<i32>>,
    #[pyo3(get)]
    prefetch: Py<PyArray2<i32>>,
}

impl StepPlan {
    pub fn from_core(py: Python<'_>, plan: CorePlan) -> PyResult<StepPlan> {
        let rows = plan.seq_lens.len();
        let block_tables = plan.block_tables.into_pyarray(py).reshape([rows, plan.max_blocks])?;
        Ok(StepPlan {
            input_ids: plan.input_ids.into_pyarray(py).unbind(),
            positions: plan.positions.into_pyarray(py).unbind(),
            slot_mapping: plan.slot_mapping.into_pyarray(py).unbind(),
            query_start_loc: plan.query_start_loc.into_pyarray(py).unbind(),
            seq_lens: plan.seq_lens.into_pyarray(py).unbind(),
            block_tables: block_tables.unbind(),
            logits_indices: plan.logits_indices.into_pyarray(py).unbind(),
            decode_from: plan.decode_from.into_pyarray(py).unbind(),
            demote: pairs(py, plan.copies.demote)?,
            promote: pairs(py, plan.copies.promote)?,
            prefetch: pairs(py, plan.copies.prefetch)?,
        })
    }
}

/// `[source, destination]` block pairs as an `(n, 2)` int32 array.
fn pairs(py: Python<'_>, pairs: Vec<[u32; 2]>) -> PyResult<Py<PyArray2<i32>>> {
    let n = pairs.len();
    let flat: Vec<i32> = pairs.into_iter().flatten().map(|b| b as i32).collect();
    Ok(flat.into_pyarray(py).reshape([n, 2])?.unbind())
}

#[pymethods]
impl StepPlan {
    #[getter]
    fn num_tokens(&self, py: Python<'_>) -> usize {
        self.input_ids.bind(py).len()
    }

    #[getter]
    fn num_seqs(&self, py: Python<'_>) -> usize {
        self.seq_lens.bind(py).len()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepPlan(num_tokens={}, num_seqs={}, demote={}, promote={}, prefetch={})",
            self.num_tokens(py),
            self.num_seqs(py),
            self.demote.bind(py).shape()[0],
            self.promote.bind(py).shape()[0],
            self.prefetch.bind(py).shape()[0]
        )
    }
}

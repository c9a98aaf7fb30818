//! Process-wide runtime settings: the kernel thread pool and which SIMD kernels run.

use oxibonsai_core::pool;
use oxibonsai_core::q1::{lut, matrix, Isa};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Sets the number of threads the kernels use (>= 1).
#[pyfunction]
pub fn set_num_threads(n: i64) -> PyResult<()> {
    if n < 1 {
        return Err(PyValueError::new_err(format!("num_threads must be >= 1, got {n}")));
    }
    pool::set_num_threads(n as usize);
    Ok(())
}

/// The number of threads the kernels use.
#[pyfunction]
pub fn get_num_threads() -> usize {
    pool::num_threads()
}

/// The active instruction set and kernels, and every instruction set this CPU can run.
#[pyfunction]
pub fn kernel_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let isa = Isa::detect();
    let info = PyDict::new(py);
    info.set_item("isa", isa.name())?;
    info.set_item("available", Isa::available().iter().map(|i| i.name()).collect::<Vec<_>>())?;
    info.set_item("gemv", lut::gemv_name(isa))?;
    info.set_item("gemm", matrix::gemm_name(isa))?;
    info.set_item("num_threads", pool::num_threads())?;
    Ok(info)
}

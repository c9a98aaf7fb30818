//! Checked, zero-copy views of numpy arrays passed in from Python, with errors that say what was
//! expected and what was given.

use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// A read-only view of a C-contiguous float32 array with `ndim` in `ndims`.
pub fn f32_array<'py>(obj: &Bound<'py, PyAny>, name: &str, ndims: &[usize]) -> PyResult<PyReadonlyArrayDyn<'py, f32>> {
    let untyped = obj.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!("{name} must be a numpy.ndarray of float32, got {}", type_name(obj)))
    })?;
    let dtype = untyped.dtype();
    let array = obj.cast::<PyArrayDyn<f32>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name} must have dtype float32, got {}",
            dtype.str().map_or("?".into(), |s| s.to_string())
        ))
    })?;
    if !ndims.contains(&untyped.ndim()) {
        let want: Vec<String> = ndims.iter().map(|d| format!("{d}-D")).collect();
        return Err(PyValueError::new_err(format!(
            "{name} must be {}, got a {}-D array of shape {:?}",
            want.join(" or "),
            untyped.ndim(),
            untyped.shape()
        )));
    }
    if !untyped.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{name} must be C-contiguous; pass numpy.ascontiguousarray({name})"
        )));
    }
    Ok(array.readonly())
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string())
}

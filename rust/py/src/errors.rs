//! The one place where core errors become Python exceptions.

use oxibonsai_core::Error;
use pyo3::exceptions::PyValueError;
use pyo3::PyErr;

/// Maps a core error to its Python exception.
pub fn to_py(err: Error) -> PyErr {
    match err {
        Error::Shape(msg) | Error::Value(msg) | Error::Unsupported(msg) => PyValueError::new_err(msg),
    }
}

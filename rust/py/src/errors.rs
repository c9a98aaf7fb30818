//! The one place where core errors become Python exceptions, and where the project's own exception
//! classes are defined (`oxibonsai.OxiBonsaiError` and its subclasses).

use oxibonsai_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyFileNotFoundError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::PyErr;

create_exception!(oxibonsai, OxiBonsaiError, PyException, "Base class of every oxibonsai-specific error.");
create_exception!(
    oxibonsai,
    GGUFError,
    OxiBonsaiError,
    "A GGUF file is malformed, truncated, or not a model oxibonsai can run."
);

create_exception!(
    oxibonsai,
    QueueFull,
    OxiBonsaiError,
    "The engine's waiting queue is full (max_waiting requests wait): retry later (HTTP 429)."
);

/// Maps a core error to its Python exception.
pub fn to_py(err: Error) -> PyErr {
    match err {
        Error::Shape(msg) | Error::Value(msg) | Error::Unsupported(msg) => PyValueError::new_err(msg),
        Error::Gguf(msg) => GGUFError::new_err(msg),
        Error::NotFound(msg) => PyFileNotFoundError::new_err(msg),
        Error::Io(msg) => PyOSError::new_err(msg),
        Error::QueueFull(msg) => QueueFull::new_err(msg),
    }
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("OxiBonsaiError", py.get_type::<OxiBonsaiError>())?;
    m.add("GGUFError", py.get_type::<GGUFError>())?;
    m.add("QueueFull", py.get_type::<QueueFull>())?;
    Ok(())
}

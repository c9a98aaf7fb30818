//! Releasing the GIL around native work, in one helper.

use pyo3::marker::Ungil;
use pyo3::Python;

/// Runs `work` with the GIL released. Inputs must already be owned Rust values or borrowed slices.
pub fn without_gil<T: Ungil, F: Ungil + FnOnce() -> T>(py: Python<'_>, work: F) -> T {
    py.detach(work)
}

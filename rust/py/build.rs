//! Exposes PyO3's interpreter cfgs (`Py_3_12`, `Py_GIL_DISABLED`, `PyPy`, ...) to this crate:
//! `small_int.rs` reads CPython's int layout, which changed in 3.12.

fn main() {
    pyo3_build_config::use_pyo3_cfgs();
}

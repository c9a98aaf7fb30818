//! `GGUFFile`: a parsed GGUF file for Python. Metadata becomes plain Python values, tensor infos
//! become dicts, and tensor data comes out as read-only numpy views of the memory map (no copy).

use std::path::PathBuf;

use numpy::ndarray::ArrayView1;
use numpy::{PyArray1, PyArrayMethods};
use oxibonsai_core::gguf::{GgufFile as CoreFile, TensorInfo, Value};
use pyo3::exceptions::{PyKeyError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::errors::to_py;
use crate::gil::without_gil;

/// A GGUF file, memory-mapped read-only and validated on open.
#[pyclass(frozen, module = "oxibonsai", name = "GGUFFile")]
pub struct GgufFile {
    pub(crate) inner: CoreFile,
    path: PathBuf,
}

impl GgufFile {
    fn info(&self, name: &str) -> PyResult<&TensorInfo> {
        self.inner.tensor(name).ok_or_else(|| PyKeyError::new_err(format!("no tensor named {name:?}")))
    }
}

#[pymethods]
impl GgufFile {
    /// Opens and validates `path` (the mapping and parsing run without the GIL).
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<GgufFile> {
        let inner = without_gil(py, || CoreFile::open(&path)).map_err(to_py)?;
        Ok(GgufFile { inner, path })
    }

    #[getter]
    fn version(&self) -> u32 {
        self.inner.version()
    }

    #[getter]
    fn alignment(&self) -> u64 {
        self.inner.alignment()
    }

    #[getter]
    fn data_offset(&self) -> u64 {
        self.inner.data_offset()
    }

    /// The path as given, as a string.
    #[getter]
    fn path<'py>(&self, py: Python<'py>) -> Bound<'py, PyString> {
        let Ok(path) = self.path.as_os_str().into_pyobject(py);
        path
    }

    /// Every key/value in file order: ints, floats, bools, strings and (nested) lists.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (key, value) in self.inner.metadata() {
            dict.set_item(key, value_to_py(py, value)?)?;
        }
        Ok(dict)
    }

    /// Tensor names in file order.
    fn tensor_names(&self) -> Vec<&str> {
        self.inner.tensors().iter().map(|t| t.name.as_str()).collect()
    }

    /// `{"name", "shape" (numpy order), "dims" (ggml order), "type", "offset", "nbytes"}`.
    fn tensor_info<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
        info_to_py(py, self.info(name)?)
    }

    /// `tensor_info` of every tensor, in file order.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner.tensors().iter().map(|t| info_to_py(py, t)).collect()
    }

    /// The tensor's raw bytes as a read-only 1-D uint8 array viewing the file's mapping; the array
    /// keeps this file (and so the mapping) alive.
    fn tensor_bytes<'py>(slf: &Bound<'py, Self>, name: &str) -> PyResult<Bound<'py, PyArray1<u8>>> {
        let this = slf.get();
        let bytes = this.inner.tensor_bytes(this.info(name)?);
        let view = ArrayView1::from(&*bytes);
        // SAFETY: `view` points into the memory map that `this.inner` owns through an `Arc`. `slf`
        // becomes the array's base object, so the map lives at least as long as the array; the class
        // is frozen, so `inner` is never replaced or dropped while `slf` lives. The map is never
        // written through this array: it is made read-only just below, before Python sees it, and
        // numpy refuses to make it writeable again because its base exposes no writable buffer.
        let array = unsafe { PyArray1::borrow_from_array(&view, slf.clone().into_any()) };
        array.try_readwrite().map_err(|e| PyRuntimeError::new_err(e.to_string()))?.make_nonwriteable();
        Ok(array)
    }

    fn __repr__(&self) -> String {
        format!(
            "GGUFFile({:?}, version={}, tensors={}, metadata={})",
            self.path.display().to_string(),
            self.inner.version(),
            self.inner.tensors().len(),
            self.inner.metadata().len()
        )
    }
}

fn info_to_py<'py>(py: Python<'py>, info: &TensorInfo) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("name", &info.name)?;
    dict.set_item("shape", PyTuple::new(py, info.shape())?)?;
    dict.set_item("dims", PyTuple::new(py, &info.dims)?)?;
    dict.set_item("type", info.ggml_type.name())?;
    dict.set_item("offset", info.offset)?;
    dict.set_item("nbytes", info.nbytes)?;
    Ok(dict)
}

fn value_to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::U8(v) => v.into_pyobject(py)?.into_any(),
        Value::I8(v) => v.into_pyobject(py)?.into_any(),
        Value::U16(v) => v.into_pyobject(py)?.into_any(),
        Value::I16(v) => v.into_pyobject(py)?.into_any(),
        Value::U32(v) => v.into_pyobject(py)?.into_any(),
        Value::I32(v) => v.into_pyobject(py)?.into_any(),
        Value::U64(v) => v.into_pyobject(py)?.into_any(),
        Value::I64(v) => v.into_pyobject(py)?.into_any(),
        Value::F32(v) => f64::from(*v).into_pyobject(py)?.into_any(),
        Value::F64(v) => v.into_pyobject(py)?.into_any(),
        Value::Bool(v) => v.into_pyobject(py)?.to_owned().into_any(),
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(_, items) => {
            PyList::new(py, items.iter().map(|item| value_to_py(py, item)).collect::<PyResult<Vec<_>>>()?)?.into_any()
        }
    })
}

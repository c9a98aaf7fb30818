//! `Q1Matrix`: Q1_0 weights, their GGUF bytes, and the matmul kernels, for Python.

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use oxibonsai_core::pool;
use oxibonsai_core::q1::{act, Isa, Kernel, Q1Matrix as CoreMatrix};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::arrays::f32_array;
use crate::errors::to_py;
use crate::gil::without_gil;

/// A Q1_0 weight matrix: 128 weights per block, one fp16 scale, one sign bit per weight.
#[pyclass(frozen, module = "oxibonsai")]
pub struct Q1Matrix {
    inner: CoreMatrix,
}

fn dims(rows: i64, cols: i64) -> PyResult<(usize, usize)> {
    if rows <= 0 || cols <= 0 {
        return Err(PyValueError::new_err(format!("rows and cols must be positive, got ({rows}, {cols})")));
    }
    Ok((rows as usize, cols as usize))
}

fn isa_arg(isa: Option<&str>) -> PyResult<Isa> {
    isa.map_or_else(|| Ok(Isa::detect()), |name| Isa::parse_available(name).map_err(to_py))
}

#[pymethods]
impl Q1Matrix {
    /// Quantizes a float32 `(rows, cols)` matrix (`cols % 128 == 0`) with ggml's reference rules.
    #[staticmethod]
    fn quantize(py: Python<'_>, w: &Bound<'_, PyAny>) -> PyResult<Q1Matrix> {
        let w = f32_array(w, "w", &[2])?;
        let (rows, cols) = (w.shape()[0], w.shape()[1]);
        let values = w.as_slice().map_err(|e| PyValueError::new_err(e.to_string()))?;
        let inner = without_gil(py, || CoreMatrix::quantize(values, rows, cols)).map_err(to_py)?;
        Ok(Q1Matrix { inner })
    }

    /// Takes GGUF Q1_0 bytes (any buffer of uint8: bytes, bytearray, memoryview, numpy uint8).
    #[staticmethod]
    fn from_bytes(py: Python<'_>, buf: &Bound<'_, PyAny>, rows: i64, cols: i64) -> PyResult<Q1Matrix> {
        let (rows, cols) = dims(rows, cols)?;
        let buffer = PyBuffer::<u8>::get(buf).map_err(|_| {
            PyTypeError::new_err(format!(
                "buf must be a bytes-like object of uint8 (bytes, bytearray, memoryview, numpy uint8), got {}",
                buf.get_type().name().map_or("?".to_string(), |n| n.to_string())
            ))
        })?;
        let bytes = buffer.to_vec(py)?;
        let inner = without_gil(py, || CoreMatrix::from_bytes(bytes, rows, cols)).map_err(to_py)?;
        Ok(Q1Matrix { inner })
    }

    /// The GGUF bytes of the matrix.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.as_bytes())
    }

    /// The float32 `(rows, cols)` weights `±d`.
    fn dequantize<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let out = PyArray2::<f32>::zeros(py, [self.inner.rows(), self.inner.cols()], false);
        {
            let mut view = out.readwrite();
            let dst = view.as_slice_mut().map_err(|e| PyValueError::new_err(e.to_string()))?;
            without_gil(py, || self.inner.dequantize_into(dst)).map_err(to_py)?;
        }
        Ok(out)
    }

    /// `W @ x` for float32 `x` of shape `(cols,)` -> `(rows,)`, or `x @ W.T` for `(n, cols)` ->
    /// `(n, rows)`. `kernel`: 'auto', 'lut', 'gemm', 'lut-gemm', 'vnni-gemm', 'perm-gemm', 'amx-gemm',
    /// 'signflip' or 'reference'; `isa`: one of `kernel_info()['available']` (default: the fastest).
    #[pyo3(signature = (x, kernel = "auto", isa = None))]
    fn matmul<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        kernel: &str,
        isa: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (kernel, isa) = (Kernel::parse(kernel).map_err(to_py)?, isa_arg(isa)?);
        let x = f32_array(x, "x", &[1, 2])?;
        let (n, cols, vector) = match x.shape() {
            [c] => (1, *c, true),
            [n, c] => (*n, *c, false),
            _ => unreachable!("f32_array checked ndim"),
        };
        if cols != self.inner.cols() {
            return Err(PyValueError::new_err(format!(
                "x has {cols} columns but the matrix has {} (shape ({}, {}))",
                self.inner.cols(),
                self.inner.rows(),
                self.inner.cols()
            )));
        }
        let rows = self.inner.rows();
        let out = if vector {
            PyArray1::<f32>::zeros(py, [rows], false).into_any()
        } else {
            PyArray2::<f32>::zeros(py, [n, rows], false).into_any()
        };
        {
            let out = out.cast::<numpy::PyArrayDyn<f32>>()?;
            let mut view = out.readwrite();
            let dst = view.as_slice_mut().map_err(|e| PyValueError::new_err(e.to_string()))?;
            let src = x.as_slice().map_err(|e| PyValueError::new_err(e.to_string()))?;
            let pool = pool::global();
            without_gil(py, || self.inner.matmul(src, n, dst, kernel, isa, &pool)).map_err(to_py)?;
        }
        Ok(out)
    }

    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows()
    }

    #[getter]
    fn cols(&self) -> usize {
        self.inner.cols()
    }

    /// Bytes of Q1_0 data (GGUF layout): rows * cols / 128 * 18.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.as_bytes().len()
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, [self.inner.rows(), self.inner.cols()])
    }

    fn __repr__(&self) -> String {
        format!(
            "Q1Matrix(rows={}, cols={}, nbytes={})",
            self.inner.rows(),
            self.inner.cols(),
            self.inner.as_bytes().len()
        )
    }
}

/// Quantized values and their per-128 scales, as numpy arrays.
type QuantizedPair<'py> = (Bound<'py, PyArray2<i16>>, Bound<'py, PyArray2<f32>>);

/// The int16 activations every quantized kernel uses (one scale per 128 values, each block's sum of
/// |q| at most 32639): `(q int16 (n, k), scales float32 (n, k/128))`.
#[pyfunction]
#[pyo3(signature = (x, isa = None))]
pub fn quantize_activations<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    isa: Option<&str>,
) -> PyResult<QuantizedPair<'py>> {
    let isa = isa_arg(isa)?;
    let x = f32_array(x, "x", &[2])?;
    let (n, k) = (x.shape()[0], x.shape()[1]);
    if k % 128 != 0 {
        return Err(PyValueError::new_err(format!("x must have a multiple of 128 columns, got {k}")));
    }
    let src = x.as_slice().map_err(|e| PyValueError::new_err(e.to_string()))?;
    let acts = without_gil(py, || act::quantize_acts(src, n, k, isa)).map_err(to_py)?;
    let q = PyArray1::from_vec(py, acts.q).reshape([n, k])?;
    let s = PyArray1::from_vec(py, acts.scale).reshape([n, k / 128])?;
    Ok((q, s))
}

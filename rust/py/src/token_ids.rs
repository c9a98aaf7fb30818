//! Token ids in from Python, fast: an exact `list` or `tuple` of ints is read through the public
//! CPython C API (no per-item PyO3 extraction), a numpy uint32 array is copied in one go, and anything
//! else goes through PyO3's generic sequence extraction. Every path raises the same errors: `TypeError`
//! for a non-int item, `OverflowError` for a negative or too large one.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::small_int;

/// Token ids from a list, tuple or numpy uint32 array of ints, or any other sequence of ints.
pub fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    token_ids_with_room(obj, 0)
}

/// [`token_ids`] in a list allocated with room for `room` more ids (a prompt that generation extends).
pub fn token_ids_with_room(obj: &Bound<'_, PyAny>, room: usize) -> PyResult<Vec<u32>> {
    if let Ok(list) = obj.cast_exact::<PyList>() {
        // SAFETY: `list` is an exact list, alive for the call, and the GIL is held.
        return unsafe { read_items(obj.py(), list.as_ptr(), room, ffi::PyList_GET_SIZE, ffi::PyList_GET_ITEM) };
    }
    if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
        // SAFETY: `tuple` is an exact tuple, alive for the call, and the GIL is held.
        return unsafe { read_items(obj.py(), tuple.as_ptr(), room, ffi::PyTuple_GET_SIZE, ffi::PyTuple_GET_ITEM) };
    }
    if let Ok(array) = obj.cast::<PyArray1<u32>>() {
        let view = array.readonly();
        let mut ids = Vec::with_capacity(view.len() + room);
        match view.as_slice() {
            Ok(slice) => ids.extend_from_slice(slice),
            Err(_) => ids.extend(view.as_array().iter()),
        }
        return Ok(ids);
    }
    let mut ids: Vec<u32> = obj.extract()?;
    ids.reserve_exact(room);
    Ok(ids)
}

/// Reads every item of the list or tuple `seq` with the given size and item accessors (into a list
/// with room for `room` more): exact ints in `0..2**32` from the object ([`small_int::read`]),
/// anything else through [`slow_id`].
///
/// # Safety
/// `seq` must be a live exact list (with the list accessors) or tuple (with the tuple accessors), and
/// the GIL must be held.
#[inline(always)]
unsafe fn read_items(
    py: Python<'_>,
    seq: *mut ffi::PyObject,
    room: usize,
    size: unsafe fn(*mut ffi::PyObject) -> ffi::Py_ssize_t,
    item: unsafe fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
) -> PyResult<Vec<u32>> {
    // SAFETY: the caller's contract: `seq` is a live list or tuple matching `size`.
    let mut ids = Vec::with_capacity(unsafe { size(seq) }.max(0) as usize + room);
    let int_type = &raw mut ffi::PyLong_Type;
    let direct = small_int::usable();
    // SAFETY: as above.
    let mut i = if direct { unsafe { read_small_ints(seq, size(seq), item, &mut ids) } } else { 0 };
    // From the first item the fast loop declined on: the size is read again every round, as a non-int
    // item's `__index__` runs Python code, which may change the list.
    // SAFETY: as above.
    while i < unsafe { size(seq) } {
        // SAFETY: `i` is below the current size, so the slot holds a live borrowed reference; reading
        // an object's type and converting an exact int run no Python code.
        let id = unsafe {
            let obj = item(seq, i);
            let exact = match (ffi::Py_TYPE(obj) == int_type, direct) {
                (true, true) => small_int::read(obj),
                (true, false) => api_u32(obj),
                (false, _) => None,
            };
            match exact {
                Some(id) => id,
                None => slow_id(py, obj)?,
            }
        };
        ids.push(id);
        i += 1;
    }
    Ok(ids)
}

/// Appends the ids of the leading run of exact ints in `0..2**32` among the first `n` items of `seq`
/// to `ids` (whose spare capacity holds at least `n`), and returns how many it read. Runs no Python code, so
/// the sequence cannot change under it.
///
/// # Safety
/// As for [`read_items`]; `n` is the sequence's size, `ids` is empty with capacity at least `n`, and
/// [`small_int::usable`] said yes.
#[inline(always)]
unsafe fn read_small_ints(
    seq: *mut ffi::PyObject,
    n: ffi::Py_ssize_t,
    item: unsafe fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
    ids: &mut Vec<u32>,
) -> ffi::Py_ssize_t {
    let int_type = &raw mut ffi::PyLong_Type;
    let spare = ids.spare_capacity_mut();
    let mut i = 0;
    while i < n {
        // SAFETY: `i < n`, the size, so the slot holds a live borrowed reference (the caller's
        // contract); only exact ints are read, by `small_int::read`, whose contract the caller met.
        let id = unsafe {
            let obj = item(seq, i);
            if ffi::Py_TYPE(obj) != int_type {
                break;
            }
            small_int::read(obj)
        };
        let Some(id) = id else { break };
        spare[i as usize].write(id);
        i += 1;
    }
    // SAFETY: the first `i` slots were just written.
    unsafe { ids.set_len(i as usize) };
    i
}

/// An exact int in `0..2**32` through the C API (where [`small_int::read`] is not usable).
///
/// # Safety
/// `obj` must be a live exact `int` and the GIL must be held.
#[inline(always)]
unsafe fn api_u32(obj: *mut ffi::PyObject) -> Option<u32> {
    let mut overflow = 0;
    // SAFETY: the caller's contract. Overflow gives -1 and sets no error; `slow_id` raises it.
    u32::try_from(unsafe { ffi::PyLong_AsLongAndOverflow(obj, &mut overflow) }).ok()
}

/// One token id from an object that is not an exact int in `0..2**32`: PyO3 converts it (a bool, a
/// numpy integer, anything with `__index__`) or raises its error, holding its own reference while
/// Python code may run.
///
/// # Safety
/// `obj` must be a live object and the GIL must be held.
#[cold]
#[inline(never)]
unsafe fn slow_id(py: Python<'_>, obj: *mut ffi::PyObject) -> PyResult<u32> {
    // SAFETY: the caller's contract; `from_borrowed_ptr` takes a new reference. A pending error of a
    // failed `PyLong_AsLong` is replaced by converting again here.
    unsafe {
        drop(PyErr::take(py));
        Bound::from_borrowed_ptr(py, obj).extract::<u32>()
    }
}

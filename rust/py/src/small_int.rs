//! Small non-negative CPython ints read straight from the object, without a C API call: the hot loop
//! of reading a list of token ids (a 64K-token prompt is 65,536 ints) spent half its time in
//! `PyLong_AsLongAndOverflow`.
//!
//! CPython stores an int as 30-bit digits after the object header; what says how many digits there are
//! (and the sign) changed in 3.12: before, `ob_size` (digit count, negative for negative ints); since,
//! `lv_tag` (`digits << 3 | sign`, sign 0 = positive, 1 = zero, 2 = negative). Ids below 2**32 need at
//! most two digits. The layout is not a stable API, so it is used only on the interpreters it is known
//! for (CPython with the GIL, full API), and only after [`layout_verified`] read known ints back
//! correctly at run time ([`usable`]); everywhere else the caller takes the API path.

use pyo3::ffi;
use std::sync::OnceLock;

/// Bits per CPython int digit.
const DIGIT_BITS: u32 = 30;

/// The start of a CPython int: the object header, the size field, the first two digits.
#[repr(C)]
struct IntHead {
    header: ffi::PyObject,
    size: isize,
    digits: [u32; 2],
}

/// `(digit count, is negative)` from the size field, on this interpreter's layout.
#[cfg(Py_3_12)]
#[inline(always)]
fn digits_and_sign(size: isize) -> (usize, bool) {
    let tag = size as usize;
    (tag >> 3, tag & 3 == 2)
}

#[cfg(not(Py_3_12))]
#[inline(always)]
fn digits_and_sign(size: isize) -> (usize, bool) {
    (size.unsigned_abs(), size < 0)
}

/// Whether this build knows the int layout at all.
const KNOWN_LAYOUT: bool = cfg!(all(not(PyPy), not(GraalPy), not(Py_GIL_DISABLED), not(Py_LIMITED_API)));

/// Whether [`read`] may be used in this process: the layout is known to this build and verified.
/// The GIL must be held (the first call makes ints to check the layout with).
pub fn usable() -> bool {
    KNOWN_LAYOUT && layout_verified()
}

/// The value of `obj` if it is in `0..2**32`; `None` for any other value ("ask the C API").
///
/// # Safety
/// `obj` must be a live exact `int`, the GIL must be held, and [`usable`] must have said yes.
#[inline(always)]
pub unsafe fn read(obj: *mut ffi::PyObject) -> Option<u32> {
    let head = obj.cast::<IntHead>();
    // SAFETY: the caller's contract: an int object is at least its header and size field, and a
    // second digit is read only when the size says it exists; `addr_of!` reads only those fields.
    unsafe {
        let (digits, negative) = digits_and_sign(std::ptr::addr_of!((*head).size).read());
        if negative {
            return None;
        }
        let low = u64::from(std::ptr::addr_of!((*head).digits[0]).read());
        match digits {
            0 => Some(0),
            1 => u32::try_from(low).ok(),
            2 => u32::try_from(low | u64::from(std::ptr::addr_of!((*head).digits[1]).read()) << DIGIT_BITS).ok(),
            _ => None,
        }
    }
}

/// Whether [`read`] reads ints made by the C API back exactly (checked once per process):
/// zero, one-digit and two-digit values, the largest u32; and declines negative and too large ones.
fn layout_verified() -> bool {
    static VERIFIED: OnceLock<bool> = OnceLock::new();
    *VERIFIED.get_or_init(|| {
        let fits = [0i64, 1, 7, (1 << 30) - 1, 1 << 30, (1 << 31) + 3, u32::MAX as i64];
        let declined = [-1i64, -(1 << 31), u32::MAX as i64 + 1, 1 << 62];
        fits.iter().all(|&v| probe(v) == Some(Some(v as u32))) && declined.iter().all(|&v| probe(v) == Some(None))
    })
}

/// What [`read`] gives for a fresh int `v` (`None` if it could not be made).
fn probe(v: i64) -> Option<Option<u32>> {
    // SAFETY: callers of `usable` hold the GIL (its contract), and `layout_verified` runs only under
    // it; the new reference is released before returning.
    unsafe {
        let obj = ffi::PyLong_FromLongLong(v);
        if obj.is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        let got = read(obj);
        ffi::Py_DecRef(obj);
        Some(got)
    }
}

//! Sharing one output buffer between pool tasks that write disjoint parts of it.

use std::marker::PhantomData;

/// A raw view of an `f32` output buffer that pool tasks write to, each task to rows no other task
/// touches (the kernels split work by row tiles).
pub struct SharedOut<'a> {
    ptr: *mut f32,
    len: usize,
    _buf: PhantomData<&'a mut [f32]>,
}

// SAFETY: tasks only write disjoint index sets (see `write`), so sharing the pointer is sound.
unsafe impl Send for SharedOut<'_> {}
// SAFETY: as above.
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    pub fn new(buf: &'a mut [f32]) -> Self {
        SharedOut { ptr: buf.as_mut_ptr(), len: buf.len(), _buf: PhantomData }
    }

    /// Copies `values` to `start..start + values.len()`.
    ///
    /// # Safety
    /// No other task may read or write that range while this runs.
    pub unsafe fn write(&self, start: usize, values: &[f32]) {
        assert!(start + values.len() <= self.len, "output range out of bounds");
        // SAFETY: in bounds (checked) and exclusive to this task (caller's contract).
        std::ptr::copy_nonoverlapping(values.as_ptr(), self.ptr.add(start), values.len());
    }

    /// The range `rows` to write in place.
    ///
    /// # Safety
    /// No other task may read or write that range while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, rows: std::ops::Range<usize>) -> &mut [f32] {
        assert!(rows.start <= rows.end && rows.end <= self.len, "output range out of bounds");
        // SAFETY: in bounds (checked) and exclusive to this task (caller's contract).
        std::slice::from_raw_parts_mut(self.ptr.add(rows.start), rows.len())
    }
}

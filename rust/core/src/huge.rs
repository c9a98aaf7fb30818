//! `HugeBuf`: a large, fixed-length, zero-initialized buffer of plain numbers on anonymous memory that
//! asks the kernel for transparent huge pages (2 MiB on x86-64 Linux). The KV cache and the repacked
//! weights live in these: attention walks the KV cache in 4 KiB pieces scattered by block tables, and
//! with 4 KiB pages each piece is a TLB miss; huge pages made a 512-position decode's attention ~15%
//! faster where the kernel grants them only on request (`transparent_hugepage/enabled` = `madvise`,
//! common on servers and VMs). The GEMV, which streams weights in order, measured no change. Small
//! buffers stay on the heap.

use std::ops::{Deref, DerefMut};

use memmap2::MmapMut;

/// Buffers at least this large go on their own huge-page-advised mapping.
const MAPPED_FROM: usize = 1 << 21;
const HUGE_PAGE: usize = 1 << 21;

/// A number type whose all-zero bytes are the value 0 and which has no padding or invalid bit
/// patterns.
///
/// # Safety
/// Every bit pattern, the all-zero one included, must be a valid value of the type.
pub unsafe trait Plain: Copy + Send + Sync + 'static {}

// SAFETY: plain integers and floats: every bit pattern is a value.
unsafe impl Plain for u8 {}
// SAFETY: as above.
unsafe impl Plain for u16 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}

/// `len` zeroed elements, on the heap or on a huge-page-advised mapping.
pub struct HugeBuf<T: Plain> {
    storage: Storage<T>,
    len: usize,
}

enum Storage<T> {
    Heap(Vec<T>),
    /// The mapping and the element offset of the first 2 MiB-aligned element.
    Mapped(MmapMut, usize),
}

impl<T: Plain> HugeBuf<T> {
    /// Zeroed, or `None` when the memory cannot be had.
    pub fn zeroed(len: usize) -> Option<HugeBuf<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        if bytes < MAPPED_FROM {
            return Some(HugeBuf { storage: Storage::Heap(vec![zero(); len]), len });
        }
        // One extra huge page of room so the buffer can start on a 2 MiB boundary.
        let map = MmapMut::map_anon(bytes.checked_add(HUGE_PAGE)?).ok()?;
        #[cfg(target_os = "linux")]
        // Only a hint: without huge pages the buffer works the same, just slower.
        let _ = map.advise(memmap2::Advice::HugePage);
        let misalign = map.as_ptr() as usize % HUGE_PAGE;
        let skip = if misalign == 0 { 0 } else { HUGE_PAGE - misalign };
        // The mapping is page-aligned, and pages are a multiple of any `T`'s size and alignment.
        debug_assert_eq!(skip % std::mem::size_of::<T>(), 0);
        Some(HugeBuf { storage: Storage::Mapped(map, skip / std::mem::size_of::<T>()), len })
    }

    /// A copy of `items` in a new buffer.
    pub fn from_slice(items: &[T]) -> Option<HugeBuf<T>> {
        let mut buf = HugeBuf::zeroed(items.len())?;
        buf.copy_from_slice(items);
        Some(buf)
    }
}

/// The bytes of `items` in memory order (little-endian on every target this crate builds for).
pub fn as_bytes<T: Plain>(items: &[T]) -> &[u8] {
    // SAFETY: `T: Plain` has no padding, so every byte of the slice is initialized; `u8` has
    // alignment 1 and the length covers exactly the slice's bytes, borrowed as long as `items`.
    unsafe { std::slice::from_raw_parts(items.as_ptr().cast::<u8>(), std::mem::size_of_val(items)) }
}

/// `items` as writable bytes.
pub fn as_bytes_mut<T: Plain>(items: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; any bytes written make a valid `T` (`Plain`: every bit pattern is
    // a value), and `&mut` makes this the only access.
    unsafe { std::slice::from_raw_parts_mut(items.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(items)) }
}

/// The all-zero value of `T`.
fn zero<T: Plain>() -> T {
    // SAFETY: `T: Plain`, so the all-zero bit pattern is a valid value.
    unsafe { std::mem::zeroed() }
}

impl<T: Plain> Deref for HugeBuf<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.storage {
            Storage::Heap(v) => v,
            // SAFETY: the mapping holds `skip` elements of alignment padding plus `len` elements (see
            // `zeroed`), page-aligned so `T`-aligned, and zero-filled by the kernel, which is a valid
            // `T` (`Plain`); it lives as long as `self`.
            Storage::Mapped(map, skip) => unsafe {
                std::slice::from_raw_parts(map.as_ptr().cast::<T>().add(*skip), self.len)
            },
        }
    }
}

impl<T: Plain> DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let len = self.len;
        match &mut self.storage {
            Storage::Heap(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes this the only access.
            Storage::Mapped(map, skip) => unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().cast::<T>().add(*skip), len)
            },
        }
    }
}

impl<T: Plain> Clone for HugeBuf<T> {
    fn clone(&self) -> HugeBuf<T> {
        HugeBuf::from_slice(self).expect("out of memory cloning a buffer")
    }
}

impl<T: Plain> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBuf(len {})", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_buffers_start_zeroed_and_hold_writes() {
        for len in [0, 5, MAPPED_FROM / 4 - 1, MAPPED_FROM / 4, 3 * MAPPED_FROM / 4 + 7] {
            let mut buf = HugeBuf::<f32>::zeroed(len).unwrap();
            assert_eq!(buf.len(), len);
            assert!(buf.iter().all(|&x| x == 0.0));
            for (i, x) in buf.iter_mut().enumerate() {
                *x = i as f32;
            }
            let copy = buf.clone();
            assert!(copy.iter().enumerate().all(|(i, &x)| x == i as f32));
        }
    }

    #[test]
    fn large_buffers_start_on_a_huge_page_boundary() {
        let buf = HugeBuf::<u16>::zeroed(MAPPED_FROM).unwrap();
        assert_eq!(buf.as_ptr() as usize % HUGE_PAGE, 0);
    }

    #[test]
    fn impossible_sizes_are_refused() {
        assert!(HugeBuf::<f32>::zeroed(usize::MAX / 2).is_none());
    }
}

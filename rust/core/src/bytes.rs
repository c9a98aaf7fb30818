//! `SharedBytes`: a cheap-to-clone, read-only view of part of an owned buffer (a memory map or a
//! `Vec<u8>`). Model weights borrow the GGUF file through it, so loading a model copies nothing and
//! the mapping lives as long as any tensor still points into it.

use std::ops::{Deref, Range};
use std::sync::Arc;

use crate::error::{Error, Result};

/// An owner of bytes that can be shared between threads (`memmap2::Mmap`, `Vec<u8>`, ...).
pub type ByteOwner = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A range of an owned buffer. Cloning shares the owner; the bytes are never copied.
#[derive(Clone)]
pub struct SharedBytes {
    owner: ByteOwner,
    start: usize,
    len: usize,
}

impl SharedBytes {
    /// The whole of `owner`.
    pub fn new(owner: ByteOwner) -> SharedBytes {
        let len = (*owner).as_ref().len();
        SharedBytes { owner, start: 0, len }
    }

    /// Takes ownership of a vector.
    pub fn from_vec(bytes: Vec<u8>) -> SharedBytes {
        SharedBytes::new(Arc::new(bytes))
    }

    /// A sub-range of this view, checked against its length.
    pub fn slice(&self, range: Range<usize>) -> Result<SharedBytes> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::Shape(format!(
                "byte range {}..{} is outside a buffer of {} bytes",
                range.start, range.end, self.len
            )));
        }
        Ok(SharedBytes { owner: self.owner.clone(), start: self.start + range.start, len: range.len() })
    }
}

impl Deref for SharedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
}

impl AsRef<[u8]> for SharedBytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_share_the_owner_and_check_bounds() {
        let all = SharedBytes::from_vec((0u8..10).collect());
        let mid = all.slice(2..7).unwrap();
        assert_eq!(&*mid, &[2, 3, 4, 5, 6]);
        assert_eq!(&*mid.slice(1..3).unwrap(), &[3, 4]);
        assert!(mid.slice(3..6).is_err());
        assert!(all.slice(0..11).is_err());
    }
}

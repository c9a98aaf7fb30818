//! `Cursor`: a bounds-checked little-endian reader over an untrusted byte slice.
//!
//! Every read checks the remaining length first and reports a truncation as `Error::Gguf` naming
//! what was being read and the byte offset, so the parser above it never indexes out of bounds.

use crate::error::{Error, Result};

/// A read position in a byte slice. Reads advance it; a failed read leaves it unchanged.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Cursor<'a> {
        Cursor { bytes, pos: 0 }
    }

    /// The offset of the next byte to be read.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes left after the current position.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// The next `n` bytes; `what` names them in the truncation error.
    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::Gguf(format!(
                "truncated file: {what} at offset {} needs {n} bytes but only {} remain",
                self.pos,
                self.remaining()
            )));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn u16(&mut self, what: &str) -> Result<u16> {
        self.array(what).map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    pub(crate) fn f32(&mut self, what: &str) -> Result<f32> {
        self.array(what).map(f32::from_le_bytes)
    }

    pub(crate) fn f64(&mut self, what: &str) -> Result<f64> {
        self.array(what).map(f64::from_le_bytes)
    }

    /// A GGUF string: a u64 byte length, then that many bytes of UTF-8.
    pub(crate) fn string(&mut self, what: &str) -> Result<String> {
        let start = self.pos;
        let len = self.u64(what)?;
        let left = self.remaining();
        if len > left as u64 {
            self.pos = start;
            return Err(Error::Gguf(format!("{what} at offset {start} claims {len} bytes but only {left} remain")));
        }
        let bytes = self.take(len as usize, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => {
                self.pos = start;
                Err(Error::Gguf(format!("{what} at offset {start} is not valid UTF-8 ({e})")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_little_endian_and_reports_truncation() {
        let bytes = [1u8, 0, 2, 0, 0, 0, 9];
        let mut cur = Cursor::new(&bytes);
        assert_eq!(cur.u16("a").unwrap(), 1);
        assert_eq!(cur.u32("b").unwrap(), 2);
        let err = cur.u64("the count").unwrap_err();
        assert_eq!(err, Error::Gguf("truncated file: the count at offset 6 needs 8 bytes but only 1 remain".into()));
        assert_eq!(cur.pos(), 6);
        assert_eq!(cur.u8("c").unwrap(), 9);
    }

    #[test]
    fn strings_check_length_and_utf8() {
        let mut ok = 3u64.to_le_bytes().to_vec();
        ok.extend_from_slice(b"abc");
        assert_eq!(Cursor::new(&ok).string("key").unwrap(), "abc");
        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.push(b'x');
        assert!(Cursor::new(&huge).string("key").unwrap_err().to_string().contains("claims"));
        let mut bad = 2u64.to_le_bytes().to_vec();
        bad.extend_from_slice(&[0xff, 0xfe]);
        assert!(Cursor::new(&bad).string("key").unwrap_err().to_string().contains("UTF-8"));
    }
}

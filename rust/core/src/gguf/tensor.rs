//! Tensor infos: a tensor's name, dims, ggml type and where its bytes lie, read and checked one at a
//! time. Placement against the file (alignment, bounds, overlaps) is checked in `layout.rs`, once
//! every info is known.

use crate::error::{Error, Result};

use super::cursor::Cursor;
use super::types::GgmlType;

/// The most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// The fewest bytes one tensor info takes: an empty name (8), n_dims (4), one dim (8), type (4),
/// offset (8).
pub(crate) const MIN_TENSOR_INFO_BYTES: u64 = 32;

/// One tensor of a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order (`ne`): `dims[0]` is the fastest-varying axis, the columns of a matrix. Every dim is
    /// at least 1.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// The absolute file offset of the first byte of data.
    pub offset: u64,
    /// Bytes of data: `n_elements / block_size * type_size`.
    pub nbytes: u64,
}

impl TensorInfo {
    /// The number of elements (the product of the dims).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// The product of `dims[1..]`: the number of rows of a matrix (1 for a vector).
    pub fn rows(&self) -> u64 {
        self.dims.iter().skip(1).fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// `dims[0]`: the length of a row.
    pub fn cols(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// The dims in numpy order (the reverse of `dims`): `(rows, cols)` for a matrix.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// Reads one tensor info. Its `offset` is still relative to the data section.
pub(crate) fn read_tensor_info(cur: &mut Cursor<'_>) -> Result<TensorInfo> {
    let at = cur.pos();
    let name = cur.string("tensor name")?;
    let fail = |msg: String| Error::Gguf(format!("tensor '{name}' (info at offset {at}) {msg}"));
    let n_dims = cur.u32("tensor dimension count")?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(fail(format!("has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(cur.u64("tensor dimension")?);
    }
    let type_id = cur.u32("tensor type")?;
    let offset = cur.u64("tensor offset")?;
    let Some(ggml_type) = GgmlType::from_id(type_id) else {
        return Err(Error::Gguf(format!("tensor '{name}' has unknown ggml type {type_id}")));
    };
    let nbytes = data_size(&dims, ggml_type).map_err(fail)?;
    Ok(TensorInfo { name, dims, ggml_type, offset, nbytes })
}

/// Bytes of data for `dims` of `ty`, or why the dims are not allowed. A zero dim is refused: ggml
/// only makes empty tensors in memory, and a model never stores one.
fn data_size(dims: &[u64], ty: GgmlType) -> std::result::Result<u64, String> {
    if dims.contains(&0) {
        return Err(format!("has a zero dimension (dims {dims:?})"));
    }
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| format!("has dims {dims:?} whose element count overflows"))?;
    let block = ty.block_size();
    if !dims[0].is_multiple_of(block) {
        return Err(format!(
            "has {} columns (dims[0]), not a multiple of the {} block size {block}",
            dims[0],
            ty.name()
        ));
    }
    (n_elements / block)
        .checked_mul(ty.type_size())
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| format!("has dims {dims:?} whose byte size overflows"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_block_table() {
        assert_eq!(data_size(&[256, 3], GgmlType::Q1_0), Ok(2 * 3 * 18));
        assert_eq!(data_size(&[7], GgmlType::F32), Ok(28));
        assert!(data_size(&[100, 2], GgmlType::Q1_0).unwrap_err().contains("block size 128"));
        assert!(data_size(&[4, 0], GgmlType::F32).unwrap_err().contains("zero dimension"));
        assert!(data_size(&[1 << 32, 1 << 32], GgmlType::F32).unwrap_err().contains("overflows"));
        assert!(data_size(&[1 << 62, 1], GgmlType::F32).unwrap_err().contains("byte size overflows"));
    }

    #[test]
    fn rows_and_cols_read_the_ggml_order() {
        let info =
            TensorInfo { name: "w".into(), dims: vec![128, 3, 2], ggml_type: GgmlType::Q1_0, offset: 0, nbytes: 0 };
        assert_eq!((info.rows(), info.cols(), info.n_elements()), (6, 128, 768));
        assert_eq!(info.shape(), vec![2, 3, 128]);
    }
}

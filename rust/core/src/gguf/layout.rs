//! Where the data section starts and where each tensor's bytes lie: the alignment, every tensor
//! offset aligned, every data range inside the file, and no two tensors sharing a byte.

use crate::error::{Error, Result};

use super::metadata::Metadata;
use super::tensor::TensorInfo;
use super::value::Value;

/// The alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// The metadata key that overrides [`DEFAULT_ALIGNMENT`]; it must hold a u32 power of two.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// The file's alignment, from `general.alignment` or the default.
pub(crate) fn alignment(meta: &Metadata) -> Result<u64> {
    match meta.get(ALIGNMENT_KEY) {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(&Value::U32(a)) if a.is_power_of_two() => Ok(a.into()),
        Some(&Value::U32(a)) => {
            Err(Error::Gguf(format!("metadata key '{ALIGNMENT_KEY}' is {a}, not a nonzero power of two")))
        }
        Some(other) => {
            Err(Error::Gguf(format!("metadata key '{ALIGNMENT_KEY}' must be a u32, found {}", other.describe())))
        }
    }
}

/// Turns each tensor's offset from relative to the data section into absolute, checking it, and
/// returns the data section's offset: the first multiple of `alignment` at or after `infos_end`.
pub(crate) fn place_tensors(tensors: &mut [TensorInfo], infos_end: u64, alignment: u64, file_len: u64) -> Result<u64> {
    let data_offset = infos_end
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| Error::Gguf(format!("data section offset overflows (alignment {alignment})")))?;
    for info in tensors.iter_mut() {
        info.offset = absolute_range(info, data_offset, alignment, file_len)?;
    }
    check_overlaps(tensors)?;
    Ok(data_offset)
}

/// The absolute offset of `info`'s data, checked for alignment and against the file's end.
fn absolute_range(info: &TensorInfo, data_offset: u64, alignment: u64, file_len: u64) -> Result<u64> {
    let (name, rel) = (&info.name, info.offset);
    if !rel.is_multiple_of(alignment) {
        return Err(Error::Gguf(format!(
            "tensor '{name}' has offset {rel} (relative to the data section), not a multiple of the alignment {alignment}"
        )));
    }
    let start = data_offset.checked_add(rel);
    let end = start.and_then(|s| s.checked_add(info.nbytes));
    match (start, end) {
        (Some(start), Some(end)) if end <= file_len => Ok(start),
        _ => Err(Error::Gguf(format!(
            "tensor '{name}' data ({} bytes at offset {rel} after the data section at {data_offset}) lies outside \
             the file of {file_len} bytes",
            info.nbytes
        ))),
    }
}

/// Refuses two tensors whose (absolute) data ranges share a byte.
fn check_overlaps(tensors: &[TensorInfo]) -> Result<()> {
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Both ranges were checked to end inside the file, so these sums cannot overflow.
        if a.offset + a.nbytes > b.offset {
            return Err(Error::Gguf(format!(
                "tensors '{}' (bytes {}..{}) and '{}' (bytes {}..{}) overlap",
                a.name,
                a.offset,
                a.offset + a.nbytes,
                b.name,
                b.offset,
                b.offset + b.nbytes
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgmlType;

    fn tensor(name: &str, offset: u64, nbytes: u64) -> TensorInfo {
        TensorInfo { name: name.into(), dims: vec![nbytes / 4], ggml_type: GgmlType::F32, offset, nbytes }
    }

    #[test]
    fn offsets_become_absolute_after_the_aligned_data_start() {
        let mut ts = vec![tensor("b", 32, 8), tensor("a", 0, 16)];
        assert_eq!(place_tensors(&mut ts, 70, 32, 136), Ok(96));
        assert_eq!((ts[0].offset, ts[1].offset), (128, 96));
    }

    #[test]
    fn misaligned_outside_and_overlapping_tensors_are_refused() {
        let err = |mut ts: Vec<TensorInfo>| place_tensors(&mut ts, 64, 32, 200).unwrap_err().to_string();
        assert!(err(vec![tensor("a", 4, 4)]).contains("not a multiple of the alignment 32"));
        assert!(err(vec![tensor("a", 128, 16)]).contains("outside the file of 200 bytes"));
        assert!(err(vec![tensor("a", u64::MAX - 31, 16)]).contains("outside"));
        assert!(err(vec![tensor("a", 0, 40), tensor("b", 32, 4)]).contains("'a' (bytes 64..104) and 'b'"));
    }
}

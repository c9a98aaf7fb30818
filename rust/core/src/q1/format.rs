//! Q1_0 quantization, dequantization and validation of raw buffers (ggml's reference rules).
//!
//! Quantizing a block: `d = (sum of |x|, summed in f32 in order) / 128`, rounded to fp16 to nearest
//! even; `bit = x >= 0` (so `-0.0` is positive). A block whose `d` does not fit fp16 is an error, not
//! a silent infinity.

use half::f16;

use super::block::{as_blocks, BlockQ1, BLOCK_BYTES, BLOCK_WEIGHTS};
use crate::error::{Error, Result};

/// Checks that a `rows x cols` Q1_0 matrix is well formed and returns its byte length.
pub fn matrix_bytes(rows: usize, cols: usize) -> Result<usize> {
    if rows == 0 || cols == 0 {
        return Err(Error::Shape(format!("a Q1_0 matrix needs rows > 0 and cols > 0, got ({rows}, {cols})")));
    }
    if !cols.is_multiple_of(BLOCK_WEIGHTS) {
        return Err(Error::Shape(format!("cols must be a multiple of 128 for Q1_0, got {cols}")));
    }
    rows.checked_mul(cols / BLOCK_WEIGHTS)
        .and_then(|blocks| blocks.checked_mul(BLOCK_BYTES))
        .ok_or_else(|| Error::Shape(format!("a ({rows}, {cols}) Q1_0 matrix is too large")))
}

/// Quantizes one block of 128 values.
fn quantize_block(x: &[f32]) -> std::result::Result<BlockQ1, f32> {
    let sum = x.iter().fold(0.0f32, |acc, v| acc + v.abs());
    let mean = sum / BLOCK_WEIGHTS as f32;
    let d = f16::from_f32(mean);
    if !d.is_finite() {
        return Err(mean);
    }
    let mut qs = [0u8; 16];
    for (j, v) in x.iter().enumerate() {
        qs[j / 8] |= u8::from(*v >= 0.0) << (j % 8);
    }
    Ok(BlockQ1 { d: d.to_le_bytes(), qs })
}

/// Quantizes a row-major `(rows, cols)` f32 matrix into Q1_0 bytes.
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let nbytes = matrix_bytes(rows, cols)?;
    if w.len() != rows * cols {
        return Err(Error::Shape(format!("expected {} values for ({rows}, {cols}), got {}", rows * cols, w.len())));
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(Error::Value(format!("weights must be finite, found {} at ({}, {})", w[i], i / cols, i % cols)));
    }
    let mut out = Vec::with_capacity(nbytes);
    for (b, chunk) in w.chunks_exact(BLOCK_WEIGHTS).enumerate() {
        let block = quantize_block(chunk).map_err(|mean| {
            let per_row = cols / BLOCK_WEIGHTS;
            Error::Value(format!(
                "block {} of row {} has mean |w| = {mean:e}, beyond fp16's range (65504)",
                b % per_row,
                b / per_row
            ))
        })?;
        out.extend_from_slice(&block.d);
        out.extend_from_slice(&block.qs);
    }
    Ok(out)
}

/// Checks a raw Q1_0 buffer: its length and that every scale is finite.
pub fn validate(bytes: &[u8], rows: usize, cols: usize) -> Result<()> {
    let expected = matrix_bytes(rows, cols)?;
    if bytes.len() != expected {
        return Err(Error::Shape(format!("a ({rows}, {cols}) Q1_0 matrix is {expected} bytes, got {}", bytes.len())));
    }
    let per_row = cols / BLOCK_WEIGHTS;
    if let Some(i) = as_blocks(bytes).iter().position(|b| !b.scale().is_finite()) {
        return Err(Error::Value(format!(
            "block {} of row {} has a non-finite fp16 scale ({})",
            i % per_row,
            i / per_row,
            as_blocks(bytes)[i].scale()
        )));
    }
    Ok(())
}

/// Dequantizes one block into 128 f32 values.
pub fn dequantize_block(block: &BlockQ1, out: &mut [f32]) {
    let d = block.scale();
    for (j, o) in out[..BLOCK_WEIGHTS].iter_mut().enumerate() {
        *o = if block.is_positive(j) { d } else { -d };
    }
}

/// Dequantizes validated Q1_0 bytes into a row-major f32 buffer of the same number of weights.
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    let blocks = as_blocks(bytes);
    assert_eq!(out.len(), blocks.len() * BLOCK_WEIGHTS);
    for (block, o) in blocks.iter().zip(out.chunks_exact_mut(BLOCK_WEIGHTS)) {
        dequantize_block(block, o);
    }
}

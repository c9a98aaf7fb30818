//! The Q1_0 weight format and its CPU matmul kernels.
//!
//! - [`block`], [`format`]: the GGUF-compatible block, quantization, dequantization, validation.
//! - [`act`]: int16 activation quantization (L1-bounded, one scale per 128) shared by every kernel.
//! - [`reference`]: the plain f32 kernel and the exact f64 value of the quantized kernels.
//! - [`signflip`]: llama.cpp's strategy over the GGUF layout (the in-house baseline).
//! - [`lut`]: the default kernels: LUT GEMV and small GEMM over weights repacked into 32-row tiles.
//! - [`amx`]: the AMX-INT8 small GEMM (Xeons with Intel AMX, two byte planes), over the GGUF layout.
//! - [`matrix`]: `Q1Matrix`, validation and dispatch by kernel family and [`Isa`].

pub mod act;
#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod block;
pub mod format;
mod isa;
pub mod lut;
pub mod matrix;
mod par;
pub mod reference;
pub mod signflip;
#[cfg(all(test, target_arch = "x86_64"))]
mod test_support;

pub use block::{BlockQ1, BLOCK_BYTES, BLOCK_WEIGHTS, GGML_TYPE_Q1_0};
pub use isa::Isa;
pub use matrix::{Kernel, Q1Matrix};

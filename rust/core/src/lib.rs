//! oxibonsai-core: everything in oxibonsai that must be fast or exact, in pure Rust.
//!
//! This crate owns the Q1_0 weight format and its CPU matmul kernels ([`q1`]), the persistent
//! worker pool they run on ([`pool`]), the GGUF file reader ([`gguf`]), the Qwen3 forward pass over a
//! paged KV cache ([`model`], [`kv`]) and the per-request samplers ([`sample`]). It never depends on
//! Python: the `oxibonsai-py` crate is a thin binding over it, and `cargo test` runs this crate alone.

pub mod bytes;
pub mod error;
pub mod fused;
pub mod gguf;
pub mod huge;
pub mod kv;
pub mod model;
pub mod pool;
pub mod q1;
pub mod sample;
pub mod sched;
pub mod spec;
pub mod step;

pub use error::{Error, Result};

//! The GGUF reader: a memory-mapped, zero-copy, fully validated view of a GGUF v2/v3 file.
//!
//! - [`cursor`]: a bounds-checked little-endian reader; the only code that indexes file bytes.
//! - [`value`]: metadata value types and their parser (nested arrays, bounded counts).
//! - [`metadata`]: the key/value section and typed lookups.
//! - [`types`]: ggml tensor types with their block and byte sizes.
//! - [`tensor`]: tensor infos (name, dims in ggml order, type, data range).
//! - [`layout`]: alignment, the data section, tensor placement and overlap checks.
//! - [`file`]: [`GgufFile`], which ties them together and hands out tensor bytes.
//!
//! The reader trusts nothing in the file: every count is checked against the bytes left before it
//! is used to allocate, all arithmetic is checked, and every failure is `Error::Gguf` naming the key
//! or tensor at fault. It never panics on any input and never copies tensor data. It only reads:
//! deciding whether a file is a model oxibonsai can run belongs to the model loader.

mod cursor;
mod file;
mod layout;
mod metadata;
mod tensor;
mod types;
mod value;

pub use file::{GgufFile, GGUF_MAGIC, SUPPORTED_VERSIONS};
pub use layout::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT};
pub use tensor::{TensorInfo, MAX_DIMS};
pub use types::GgmlType;
pub use value::{Value, ValueType, MAX_ARRAY_NESTING};

//! `GgufFile`: a parsed, validated GGUF file over a memory map (or any shared buffer).
//!
//! Parsing reads the header, metadata and tensor infos and checks all of them before returning;
//! afterwards nothing is re-read or re-checked. Tensor data is never copied: [`GgufFile::tensor_bytes`]
//! hands out views that share the mapping and keep it alive.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use crate::bytes::SharedBytes;
use crate::error::{Error, Result};

use super::cursor::Cursor;
use super::layout::{alignment, place_tensors};
use super::metadata::{context, required, Metadata, MIN_KV_BYTES};
use super::tensor::{read_tensor_info, TensorInfo, MIN_TENSOR_INFO_BYTES};
use super::value::Value;

/// The first four bytes of every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// The versions this reader parses (little-endian only).
pub const SUPPORTED_VERSIONS: [u32; 2] = [2, 3];

/// A GGUF file: its metadata and tensor table, and the bytes they describe.
pub struct GgufFile {
    bytes: SharedBytes,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl GgufFile {
    /// Maps the file at `path` read-only and parses it. A missing path is `Error::NotFound`, any
    /// other OS failure `Error::Io`, and a malformed file `Error::Gguf` naming the path.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let shown = path.display();
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound(format!("no such file: {shown}")),
            _ => Error::Io(format!("cannot open {shown}: {e}")),
        })?;
        let len = file.metadata().map_err(|e| Error::Io(format!("cannot stat {shown}: {e}")))?.len();
        let bytes = if len == 0 {
            SharedBytes::from_vec(Vec::new()) // mapping zero bytes is an error on some systems
        } else {
            // SAFETY: `Mmap::map` is unsafe because another process may modify or truncate the file
            // while it is mapped, which would change bytes behind shared references (or raise
            // SIGBUS). We treat the file as read-only input: the parser validates everything it
            // reads, and we never hand out `&mut`. Modifying a model file while it is being served
            // is outside what this reader can defend against, as for every mmap-based loader.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::Io(format!("cannot map {shown}: {e}")))?;
            SharedBytes::new(Arc::new(map))
        };
        GgufFile::from_bytes(bytes).map_err(|e| context(&shown.to_string(), e))
    }

    /// Parses a GGUF file held in memory; the result shares `bytes`.
    pub fn from_bytes(bytes: SharedBytes) -> Result<GgufFile> {
        let mut cur = Cursor::new(&bytes);
        let (version, tensor_count, kv_count) = read_header(&mut cur)?;
        let metadata = Metadata::read(&mut cur, kv_count)?;
        let alignment = alignment(&metadata)?;
        let mut tensors = Vec::with_capacity(tensor_count);
        let mut tensor_index = HashMap::with_capacity(tensor_count);
        for _ in 0..tensor_count {
            let at = cur.pos();
            let info = read_tensor_info(&mut cur)?;
            if tensor_index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(Error::Gguf(format!("duplicate tensor '{}' (info at offset {at})", info.name)));
            }
            tensors.push(info);
        }
        let data_offset = place_tensors(&mut tensors, cur.pos() as u64, alignment, bytes.len() as u64)?;
        Ok(GgufFile { bytes, version, alignment, data_offset, metadata, tensors, tensor_index })
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the data section and of every tensor (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The absolute file offset where the data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Every key/value, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        self.metadata.entries()
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// Any integer type holding a non-negative value.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.metadata.get_u64(key)
    }

    /// A float, or an integer converted to f64.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.metadata.get_f64(key)
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.metadata.get_str(key)
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.metadata.get_bool(key)
    }

    /// The elements of an array (of any element type).
    pub fn get_array(&self, key: &str) -> Result<Option<&[Value]>> {
        self.metadata.get_array(key)
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        required(key, self.get_u64(key))
    }

    pub fn require_f64(&self, key: &str) -> Result<f64> {
        required(key, self.get_f64(key))
    }

    pub fn require_str(&self, key: &str) -> Result<&str> {
        required(key, self.get_str(key))
    }

    pub fn require_bool(&self, key: &str) -> Result<bool> {
        required(key, self.get_bool(key))
    }

    pub fn require_array(&self, key: &str) -> Result<&[Value]> {
        required(key, self.get_array(key))
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of `info` (one of this file's tensors), sharing the file's bytes without a copy.
    ///
    /// # Panics
    /// If `info` describes bytes outside this file, which only a `TensorInfo` made by hand or taken
    /// from another file can do.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> SharedBytes {
        let range = usize::try_from(info.offset)
            .ok()
            .and_then(|start| Some(start..start.checked_add(usize::try_from(info.nbytes).ok()?)?));
        match range.map(|r| self.bytes.slice(r)) {
            Some(Ok(bytes)) => bytes,
            _ => panic!(
                "tensor '{}' ({} bytes at {}) is not part of this GGUF file",
                info.name, info.nbytes, info.offset
            ),
        }
    }

    /// A 64-bit identity of the tensors: xxh3 over every tensor's name, type and dims, and its bytes
    /// (all of a tensor up to 64 KiB; above, its first, middle and last 16 KiB). Two files with the
    /// same tensors get the same value without reading gigabytes; a retrained or requantized model
    /// changes its norms (read whole) and samples. Prefix-cache files use it to refuse another model.
    pub fn tensor_fingerprint(&self) -> u64 {
        const WHOLE: usize = 64 << 10;
        const SAMPLE: usize = 16 << 10;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for info in &self.tensors {
            h.update(info.name.as_bytes());
            h.update(&(info.ggml_type as u32).to_le_bytes());
            for d in &info.dims {
                h.update(&d.to_le_bytes());
            }
            let bytes = self.tensor_bytes(info);
            if bytes.len() <= WHOLE {
                h.update(&bytes);
            } else {
                let mid = bytes.len() / 2 - SAMPLE / 2;
                for at in [0, mid, bytes.len() - SAMPLE] {
                    h.update(&bytes[at..at + SAMPLE]);
                }
            }
        }
        h.digest()
    }

    /// The size of the whole file in bytes.
    pub fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// Whether the file is empty (never, for a parsed file; here for the `len` convention).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// Reads magic, version and the two counts, refusing counts the rest of the file cannot hold.
fn read_header(cur: &mut Cursor<'_>) -> Result<(u32, usize, usize)> {
    let magic = cur.take(4, "magic")?;
    if magic != GGUF_MAGIC {
        return Err(Error::Gguf(format!(
            "not a GGUF file: it starts with {:?}, not \"GGUF\"",
            String::from_utf8_lossy(magic)
        )));
    }
    let version = cur.u32("version")?;
    if !SUPPORTED_VERSIONS.contains(&version) {
        let hint = if SUPPORTED_VERSIONS.contains(&version.swap_bytes()) { " (a big-endian file?)" } else { "" };
        return Err(Error::Gguf(format!(
            "unsupported GGUF version {version}{hint}; this reader supports versions 2 and 3"
        )));
    }
    let tensor_count = cur.u64("tensor count")?;
    let kv_count = cur.u64("metadata count")?;
    let need = kv_count
        .checked_mul(MIN_KV_BYTES)
        .and_then(|kv| tensor_count.checked_mul(MIN_TENSOR_INFO_BYTES)?.checked_add(kv));
    if need.is_none_or(|need| need > cur.remaining() as u64) {
        return Err(Error::Gguf(format!(
            "header claims {kv_count} metadata entries and {tensor_count} tensors, more than the {} bytes after \
             the header can hold",
            cur.remaining()
        )));
    }
    // Both counts are now bounded by the file size, so they fit in usize.
    Ok((version, tensor_count as usize, kv_count as usize))
}

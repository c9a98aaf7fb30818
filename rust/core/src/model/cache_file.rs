//! Prefix-cache files: the blocks a runner's prefix cache holds (their chains, tokens, salts and KV
//! bytes) saved to disk and loaded into a runner of the same model later, so a restarted server or
//! another replica starts with its long shared prompts already computed.
//!
//! Layout (little-endian): a header (`MAGIC`, `VERSION` u32, the runner's
//! [`identity`](ModelRunner::identity) u64, block bytes u64, records u64), one record per block
//! (parent index u32, `NONE` for the first block of a chain; salt length u32, `NONE` for no salt; 16
//! token ids u32; an xxh3-64 checksum of the record's fields and the block's KV bytes u64; the salt's
//! bytes), then every block's KV bytes in record order. Parents come before their children, so
//! loading is one pass. The identity covers the tensors, every config
//! value (rope scaling included), the KV dtype and layout: a file written for anything else is
//! refused. Loading validates the whole index against the file's length before it changes anything,
//! checks each block's checksum before caching it, and only fills free blocks.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3;

use super::runner::ModelRunner;
use crate::error::{Error, Result};
use crate::kv::{BlockKey, CachedBlock, BLOCK_TOKENS};

const MAGIC: &[u8; 8] = b"OXBKVC\r\n";
const VERSION: u32 = 1;
const NONE: u32 = u32::MAX;
const HEADER_BYTES: u64 = 8 + 4 + 8 + 8 + 8;
/// A record's fixed part: parent, salt length, tokens, checksum.
const RECORD_BYTES: u64 = 4 + 4 + 4 * BLOCK_TOKENS as u64 + 8;
/// Salts are request metadata, short; a longer one means a corrupt file.
const MAX_SALT_BYTES: u32 = 1 << 16;

/// One block's place in the file.
struct Record {
    parent: Option<usize>,
    tokens: [u32; BLOCK_TOKENS],
    salt: Option<Arc<str>>,
    checksum: u64,
}

impl ModelRunner {
    /// What a cache file must have been written for: the tensors, the config, the KV dtype and size.
    pub fn identity(&self) -> u64 {
        let mut h = Xxh3::new();
        h.update(MAGIC);
        h.update(&self.model().fingerprint.to_le_bytes());
        h.update(format!("{:?} {:?} {}", self.model().config, self.kv_dtype(), self.block_bytes()).as_bytes());
        h.digest()
    }

    /// Writes every cached block to `path` (through a temporary file renamed over it, so a reader
    /// never sees half a file); returns how many.
    pub fn save_prefix_cache(&self, path: &Path) -> Result<usize> {
        let blocks = self.table().cached_blocks();
        let partial = path.with_extension(format!("partial{}", std::process::id()));
        let written = self.write_cache_file(&partial, &blocks).and_then(|()| {
            std::fs::rename(&partial, path).map_err(|e| io_error(path, &e))?;
            Ok(blocks.len())
        });
        if written.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        written
    }

    fn write_cache_file(&self, path: &Path, blocks: &[CachedBlock]) -> Result<()> {
        let io = |e: std::io::Error| io_error(path, &e);
        let mut out = BufWriter::new(File::create(path).map_err(io)?);
        let mut kv = Vec::with_capacity(self.block_bytes());
        let mut header = Vec::with_capacity(HEADER_BYTES as usize);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        for word in [self.identity(), self.block_bytes() as u64, blocks.len() as u64] {
            header.extend_from_slice(&word.to_le_bytes());
        }
        out.write_all(&header).map_err(io)?;
        // The KV goes after the records, which hold its checksums: write it first (each block read
        // once), then go back for the records.
        let salts: u64 = blocks.iter().map(|b| b.salt.as_ref().map_or(0, |s| s.len() as u64)).sum();
        out.seek(SeekFrom::Start(HEADER_BYTES + blocks.len() as u64 * RECORD_BYTES + salts)).map_err(io)?;
        let mut records = Vec::with_capacity(blocks.len() * RECORD_BYTES as usize);
        for b in blocks {
            kv.clear();
            self.read_block(b.block, &mut kv);
            records.extend(record_bytes(b, entry_checksum(b.parent, &b.tokens, b.salt.as_deref(), &kv)));
            out.write_all(&kv).map_err(io)?;
        }
        out.seek(SeekFrom::Start(HEADER_BYTES)).map_err(io)?;
        out.write_all(&records).map_err(io)?;
        out.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)
    }

    /// Caches the blocks of the file at `path` in free blocks, chain by chain (a block whose parent
    /// found no room is skipped); returns how many it cached. Blocks already cached with the same
    /// contents count and stay as they are. Prefix caching must be on.
    pub fn load_prefix_cache(&mut self, path: &Path) -> Result<usize> {
        if !self.table().prefix_caching() {
            return Err(Error::Value("prefix caching is off: a prefix-cache file cannot be loaded".into()));
        }
        let io = |e: std::io::Error| io_error(path, &e);
        let file = File::open(path).map_err(|e| io_error(path, &e))?;
        let length = file.metadata().map_err(io)?.len();
        let mut input = BufReader::new(file);
        let records = self.read_index(path, &mut input, length)?;
        let data_at = length - records.len() as u64 * self.block_bytes() as u64;
        input.seek(SeekFrom::Start(data_at)).map_err(io)?;
        let mut kv = vec![0u8; self.block_bytes()];
        let mut keys: Vec<Option<BlockKey>> = Vec::with_capacity(records.len());
        let (table, mut write) = self.table_and_blocks();
        for (i, r) in records.iter().enumerate() {
            input.read_exact(&mut kv).map_err(io)?;
            if entry_checksum(r.parent, &r.tokens, r.salt.as_deref(), &kv) != r.checksum {
                let loaded = keys.iter().flatten().count();
                return Err(corrupt(
                    path,
                    &format!("block {i} fails its checksum ({loaded} blocks before it were loaded)"),
                ));
            }
            let key = match r.parent.map(|p| keys[p]) {
                Some(None) => None, // the parent was not cached: nothing can continue it
                parent => table.restore_block(parent.flatten(), &r.tokens, r.salt.as_ref(), |b| write(b, &kv))?,
            };
            if key.is_none() && table.num_free_blocks() == 0 {
                break;
            }
            keys.push(key);
        }
        Ok(keys.iter().flatten().count())
    }

    /// Reads and checks the header and every record; the file's length must be exactly theirs plus
    /// the blocks'.
    fn read_index(&self, path: &Path, input: &mut impl Read, length: u64) -> Result<Vec<Record>> {
        let mut header = [0u8; HEADER_BYTES as usize];
        read_exact(path, input, &mut header)?;
        if &header[..8] != MAGIC {
            return Err(corrupt(path, "not an oxibonsai prefix-cache file"));
        }
        let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().expect("8 bytes"));
        let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(corrupt(path, &format!("version {version}; this build reads version {VERSION}")));
        }
        if word(12) != self.identity() || word(20) != self.block_bytes() as u64 {
            return Err(Error::Value(format!(
                "{} was written by another model or with other settings (tensors, rope scaling, KV \
                 dtype); it cannot be loaded into this one",
                path.display()
            )));
        }
        let count = word(28);
        if count > length / (RECORD_BYTES + self.block_bytes() as u64) {
            return Err(corrupt(
                path,
                &format!("it lists {count} blocks, more than its {length} bytes can hold (truncated?)"),
            ));
        }
        let records = (0..count as usize).map(|i| self.read_record(path, input, i)).collect::<Result<Vec<_>>>()?;
        let salts: u64 = records.iter().map(|r| r.salt.as_ref().map_or(0, |s| s.len() as u64)).sum();
        let want = HEADER_BYTES + count * (RECORD_BYTES + self.block_bytes() as u64) + salts;
        if length != want {
            return Err(corrupt(path, &format!("{length} bytes where its index says {want} (truncated?)")));
        }
        Ok(records)
    }

    fn read_record(&self, path: &Path, input: &mut impl Read, i: usize) -> Result<Record> {
        let mut fixed = [0u8; RECORD_BYTES as usize];
        read_exact(path, input, &mut fixed)?;
        let word = |at: usize| u32::from_le_bytes(fixed[at..at + 4].try_into().expect("4 bytes"));
        let parent = match word(0) {
            NONE => None,
            p if (p as usize) < i => Some(p as usize),
            p => return Err(corrupt(path, &format!("block {i}'s parent {p} does not come before it"))),
        };
        let vocab = self.model().config.vocab;
        let tokens: [u32; BLOCK_TOKENS] = std::array::from_fn(|t| word(8 + 4 * t));
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(corrupt(path, &format!("block {i} holds token {t}, beyond the vocabulary ({vocab})")));
        }
        let checksum = u64::from_le_bytes(fixed[RECORD_BYTES as usize - 8..].try_into().expect("8 bytes"));
        let salt = match word(4) {
            NONE => None,
            n if n <= MAX_SALT_BYTES => {
                let mut bytes = vec![0u8; n as usize];
                read_exact(path, input, &mut bytes)?;
                let text =
                    String::from_utf8(bytes).map_err(|_| corrupt(path, &format!("block {i}'s salt is not UTF-8")))?;
                Some(Arc::from(text))
            }
            n => return Err(corrupt(path, &format!("block {i}'s salt of {n} bytes is too long"))),
        };
        Ok(Record { parent, tokens, salt, checksum })
    }
}

/// xxh3-64 of everything a block's cache entry depends on: its parent, tokens and salt (so a damaged
/// record cannot file good KV under other text) and its KV bytes.
fn entry_checksum(parent: Option<usize>, tokens: &[u32; BLOCK_TOKENS], salt: Option<&str>, kv: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&parent.map_or(NONE, |p| p as u32).to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.update(&salt.map_or(NONE, |s| s.len() as u32).to_le_bytes());
    h.update(salt.unwrap_or_default().as_bytes());
    h.update(kv);
    h.digest()
}

fn record_bytes(b: &CachedBlock, checksum: u64) -> Vec<u8> {
    let salt = b.salt.as_deref().map(str::as_bytes);
    let mut out = Vec::with_capacity(RECORD_BYTES as usize + salt.map_or(0, <[u8]>::len));
    out.extend_from_slice(&b.parent.map_or(NONE, |p| p as u32).to_le_bytes());
    out.extend_from_slice(&salt.map_or(NONE, |s| s.len() as u32).to_le_bytes());
    for t in b.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&checksum.to_le_bytes());
    out.extend_from_slice(salt.unwrap_or_default());
    out
}

fn read_exact(path: &Path, input: &mut impl Read, buf: &mut [u8]) -> Result<()> {
    input.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => corrupt(path, "it ends early (truncated?)"),
        _ => io_error(path, &e),
    })
}

fn corrupt(path: &Path, why: &str) -> Error {
    Error::Value(format!("{} is not a valid prefix-cache file: {why}", path.display()))
}

fn io_error(path: &Path, e: &std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::NotFound => Error::NotFound(format!("no such file or directory: {}", path.display())),
        _ => Error::Io(format!("{}: {e}", path.display())),
    }
}

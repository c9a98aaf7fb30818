//! A tiny GGUF writer for tests: `Raw` appends exact bytes (so tests can write hostile files), and
//! `build` lays out a well-formed file from key/values and tensors.

use oxibonsai_core::gguf::Value;

/// An append-only little-endian byte builder.
#[derive(Default)]
pub struct Raw(pub Vec<u8>);

impl Raw {
    pub fn u32(&mut self, v: u32) -> &mut Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bytes(&mut self, b: &[u8]) -> &mut Raw {
        self.0.extend_from_slice(b);
        self
    }

    /// A GGUF string: u64 length, bytes.
    pub fn string(&mut self, s: &[u8]) -> &mut Raw {
        self.u64(s.len() as u64).bytes(s)
    }

    /// Magic, version, tensor count, key/value count.
    pub fn header(&mut self, version: u32, n_tensors: u64, n_kv: u64) -> &mut Raw {
        self.bytes(b"GGUF").u32(version).u64(n_tensors).u64(n_kv)
    }

    /// A value without its type id.
    pub fn payload(&mut self, v: &Value) -> &mut Raw {
        match v {
            Value::U8(x) => self.bytes(&[*x]),
            Value::I8(x) => self.bytes(&x.to_le_bytes()),
            Value::U16(x) => self.bytes(&x.to_le_bytes()),
            Value::I16(x) => self.bytes(&x.to_le_bytes()),
            Value::U32(x) => self.u32(*x),
            Value::I32(x) => self.bytes(&x.to_le_bytes()),
            Value::U64(x) => self.u64(*x),
            Value::I64(x) => self.bytes(&x.to_le_bytes()),
            Value::F32(x) => self.bytes(&x.to_le_bytes()),
            Value::F64(x) => self.bytes(&x.to_le_bytes()),
            Value::Bool(x) => self.bytes(&[*x as u8]),
            Value::String(s) => self.string(s.as_bytes()),
            Value::Array(ty, items) => {
                self.u32(ty.id()).u64(items.len() as u64);
                items.iter().for_each(|item| {
                    self.payload(item);
                });
                self
            }
        }
    }

    /// A key/value: key, type id, payload.
    pub fn kv(&mut self, key: &str, v: &Value) -> &mut Raw {
        self.string(key.as_bytes()).u32(v.value_type().id()).payload(v)
    }

    /// A tensor info with a data offset relative to the data section.
    pub fn tensor_info(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Raw {
        self.string(name.as_bytes()).u32(dims.len() as u32);
        dims.iter().for_each(|&d| {
            self.u64(d);
        });
        self.u32(type_id).u64(offset)
    }

    /// Zero bytes up to the next multiple of `alignment`.
    pub fn pad(&mut self, alignment: u64) -> &mut Raw {
        let len = (self.0.len() as u64).next_multiple_of(alignment);
        self.0.resize(len as usize, 0);
        self
    }
}

/// A tensor to write: its data goes at `offset` (relative to the data section) if given, else after
/// the previous tensor, aligned.
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub offset: Option<u64>,
    pub data: Vec<u8>,
}

impl TensorSpec {
    pub fn new(name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) -> TensorSpec {
        TensorSpec { name: name.into(), dims: dims.to_vec(), type_id, offset: None, data }
    }

    pub fn at(mut self, offset: u64) -> TensorSpec {
        self.offset = Some(offset);
        self
    }
}

/// A GGUF v3 file. `alignment` must match `general.alignment` in `kvs` (or be 32 without it).
pub fn build(kvs: &[(&str, Value)], tensors: &[TensorSpec], alignment: u64) -> Vec<u8> {
    let mut raw = Raw::default();
    raw.header(3, tensors.len() as u64, kvs.len() as u64);
    kvs.iter().for_each(|(k, v)| {
        raw.kv(k, v);
    });
    let mut next = 0u64;
    let mut placed = Vec::new();
    for t in tensors {
        let offset = t.offset.unwrap_or(next.next_multiple_of(alignment));
        raw.tensor_info(&t.name, &t.dims, t.type_id, offset);
        next = offset.saturating_add(t.data.len() as u64);
        placed.push(offset);
    }
    raw.pad(alignment);
    let data_start = raw.0.len();
    for (t, &offset) in tensors.iter().zip(&placed).filter(|(t, _)| !t.data.is_empty()) {
        let start = data_start + offset as usize;
        if raw.0.len() < start + t.data.len() {
            raw.0.resize(start + t.data.len(), 0);
        }
        raw.0[start..start + t.data.len()].copy_from_slice(&t.data);
    }
    raw.0
}

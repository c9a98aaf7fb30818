//! The key/value section: reading it in file order, refusing duplicate keys, and typed lookups whose
//! errors name the key, what was expected and what the file holds.

use std::collections::HashMap;

use crate::error::{Error, Result};

use super::cursor::Cursor;
use super::value::{read_type, read_value, Value};

/// The fewest bytes one key/value takes: an empty key (8), a type (4), a one-byte value (1).
pub(crate) const MIN_KV_BYTES: u64 = 13;

/// Metadata in file order, with an index by key.
#[derive(Debug, Clone, Default)]
pub(crate) struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    /// Reads `count` key/values; the caller has checked `count` against the bytes left.
    pub(crate) fn read(cur: &mut Cursor<'_>, count: usize) -> Result<Metadata> {
        let mut meta = Metadata { entries: Vec::with_capacity(count), index: HashMap::with_capacity(count) };
        for i in 0..count {
            let at = cur.pos();
            let key = cur.string("metadata key").map_err(|e| context(&format!("metadata entry #{i}"), e))?;
            let value = read_type(cur, "metadata value type")
                .and_then(|ty| read_value(cur, ty, 0))
                .map_err(|e| context(&format!("metadata key '{key}'"), e))?;
            if meta.index.contains_key(&key) {
                return Err(Error::Gguf(format!("duplicate metadata key '{key}' at offset {at}")));
            }
            meta.index.insert(key.clone(), meta.entries.len());
            meta.entries.push((key, value));
        }
        Ok(meta)
    }

    pub(crate) fn entries(&self) -> &[(String, Value)] {
        &self.entries
    }

    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// The value under `key` converted by `convert`, or an error naming what was `expected`.
    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        convert: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => convert(value).map(Some).ok_or_else(|| {
                Error::Gguf(format!("metadata key '{key}' must be {expected}, found {}", value.describe()))
            }),
        }
    }

    pub(crate) fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", Value::as_u64)
    }

    pub(crate) fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", Value::as_f64)
    }

    pub(crate) fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", Value::as_str)
    }

    pub(crate) fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", Value::as_bool)
    }

    pub(crate) fn get_array(&self, key: &str) -> Result<Option<&[Value]>> {
        self.typed(key, "an array", Value::as_array)
    }
}

/// `found`, or the error for a missing `key`.
pub(crate) fn required<T>(key: &str, found: Result<Option<T>>) -> Result<T> {
    found?.ok_or_else(|| Error::Gguf(format!("missing metadata key '{key}'")))
}

/// Prefixes a GGUF error with what was being read.
pub(crate) fn context(what: &str, err: Error) -> Error {
    match err {
        Error::Gguf(msg) => Error::Gguf(format!("{what}: {msg}")),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(entries: Vec<(&str, Value)>) -> Metadata {
        let mut m = Metadata::default();
        for (k, v) in entries {
            m.index.insert(k.to_string(), m.entries.len());
            m.entries.push((k.to_string(), v));
        }
        m
    }

    #[test]
    fn typed_lookups_convert_or_name_the_key() {
        let m = meta(vec![
            ("n", Value::U32(4)),
            ("neg", Value::I32(-1)),
            ("eps", Value::F32(0.5)),
            ("s", Value::Bool(true)),
        ]);
        assert_eq!(m.get_u64("n"), Ok(Some(4)));
        assert_eq!(m.get_f64("n"), Ok(Some(4.0)));
        assert_eq!(m.get_f64("eps"), Ok(Some(0.5)));
        assert_eq!(m.get_bool("s"), Ok(Some(true)));
        assert_eq!(m.get_u64("absent"), Ok(None));
        assert_eq!(
            m.get_u64("neg"),
            Err(Error::Gguf("metadata key 'neg' must be a non-negative integer, found i32 -1".into()))
        );
        assert_eq!(m.get_str("n"), Err(Error::Gguf("metadata key 'n' must be a string, found u32 4".into())));
        assert_eq!(required("q.x", m.get_u64("q.x")), Err(Error::Gguf("missing metadata key 'q.x'".into())));
    }
}

//! Metadata values: the thirteen GGUF value types, their parser, and lossless conversions.
//!
//! An array keeps its element type next to its elements (`Value::Array(ValueType, Vec<Value>)`), so
//! an empty array still says what it would hold. The parser trusts no count: an array's count times
//! the smallest encoding of its element type must fit in the bytes left before anything is
//! allocated, and arrays nest at most [`MAX_ARRAY_NESTING`] deep.

use crate::error::{Error, Result};

use super::cursor::Cursor;

/// The deepest nesting of arrays accepted (an array of scalars is one level).
pub const MAX_ARRAY_NESTING: usize = 8;

/// The type id of a metadata value, as stored in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

/// `(type, name, smallest encoding in bytes)`, indexed by the type id (the enum's discriminant).
const VALUE_TYPES: [(ValueType, &str, usize); 13] = [
    (ValueType::U8, "u8", 1),
    (ValueType::I8, "i8", 1),
    (ValueType::U16, "u16", 2),
    (ValueType::I16, "i16", 2),
    (ValueType::U32, "u32", 4),
    (ValueType::I32, "i32", 4),
    (ValueType::F32, "f32", 4),
    (ValueType::Bool, "bool", 1),
    (ValueType::String, "string", 8),
    (ValueType::Array, "array", 12),
    (ValueType::U64, "u64", 8),
    (ValueType::I64, "i64", 8),
    (ValueType::F64, "f64", 8),
];

impl ValueType {
    /// The type with this id, if the format defines one.
    pub fn from_id(id: u32) -> Option<ValueType> {
        VALUE_TYPES.get(id as usize).map(|row| row.0)
    }

    /// The id stored in the file.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// A short lower-case name: "u32", "string", "array", ...
    pub fn name(self) -> &'static str {
        VALUE_TYPES[self as usize].1
    }

    /// The fewest bytes one value of this type takes in a file (an empty string or array included).
    pub fn min_encoded_size(self) -> usize {
        VALUE_TYPES[self as usize].2
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    /// The element type, then the elements (all of that type).
    Array(ValueType, Vec<Value>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
        }
    }

    /// Any integer, as i128 (every integer type fits).
    pub fn as_integer(&self) -> Option<i128> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::I8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::U64(v) => Some(v.into()),
            Value::I64(v) => Some(v.into()),
            _ => None,
        }
    }

    /// Any integer that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_integer().and_then(|v| u64::try_from(v).ok())
    }

    /// A float, or an integer converted to the nearest f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_integer().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements of an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, items) => Some(items),
            _ => None,
        }
    }

    /// A short description for error messages: "i32 -3", "string \"abc\"", "array of 3 u32".
    pub fn describe(&self) -> String {
        match self {
            Value::String(s) if s.chars().count() > 40 => {
                format!("string {:?}...", s.chars().take(40).collect::<String>())
            }
            Value::String(s) => format!("string {s:?}"),
            Value::Array(ty, items) => format!("array of {} {}", items.len(), ty.name()),
            Value::Bool(b) => format!("bool {b}"),
            Value::F32(v) => format!("f32 {v}"),
            Value::F64(v) => format!("f64 {v}"),
            other => format!("{} {}", other.value_type().name(), other.as_integer().unwrap_or_default()),
        }
    }
}

/// Reads a value type id, rejecting ids the format does not define.
pub(crate) fn read_type(cur: &mut Cursor<'_>, what: &str) -> Result<ValueType> {
    let at = cur.pos();
    let id = cur.u32(what)?;
    ValueType::from_id(id).ok_or_else(|| Error::Gguf(format!("unknown value type {id} at offset {at}")))
}

/// Reads one value of type `ty`; `nesting` is the number of arrays it sits in.
pub(crate) fn read_value(cur: &mut Cursor<'_>, ty: ValueType, nesting: usize) -> Result<Value> {
    Ok(match ty {
        ValueType::U8 => Value::U8(cur.u8("u8 value")?),
        ValueType::I8 => Value::I8(cur.u8("i8 value")? as i8),
        ValueType::U16 => Value::U16(cur.u16("u16 value")?),
        ValueType::I16 => Value::I16(cur.u16("i16 value")? as i16),
        ValueType::U32 => Value::U32(cur.u32("u32 value")?),
        ValueType::I32 => Value::I32(cur.u32("i32 value")? as i32),
        ValueType::U64 => Value::U64(cur.u64("u64 value")?),
        ValueType::I64 => Value::I64(cur.u64("i64 value")? as i64),
        ValueType::F32 => Value::F32(cur.f32("f32 value")?),
        ValueType::F64 => Value::F64(cur.f64("f64 value")?),
        ValueType::Bool => Value::Bool(read_bool(cur)?),
        ValueType::String => Value::String(cur.string("string value")?),
        ValueType::Array => read_array(cur, nesting + 1)?,
    })
}

fn read_bool(cur: &mut Cursor<'_>) -> Result<bool> {
    let at = cur.pos();
    match cur.u8("bool value")? {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(Error::Gguf(format!("bool value at offset {at} is {other}, not 0 or 1"))),
    }
}

/// An array at nesting level `level` (1 for an array that is not inside another).
fn read_array(cur: &mut Cursor<'_>, level: usize) -> Result<Value> {
    let at = cur.pos();
    if level > MAX_ARRAY_NESTING {
        return Err(Error::Gguf(format!(
            "array at offset {at} is nested {level} deep; at most {MAX_ARRAY_NESTING} levels are allowed"
        )));
    }
    let elem = read_type(cur, "array element type")?;
    let count = cur.u64("array length")?;
    let fits = count.checked_mul(elem.min_encoded_size() as u64).is_some_and(|need| need <= cur.remaining() as u64);
    if !fits {
        return Err(Error::Gguf(format!(
            "array at offset {at} claims {count} {} elements but only {} bytes remain",
            elem.name(),
            cur.remaining()
        )));
    }
    // `count` is now bounded by the bytes left in the file, so this allocation is too.
    let mut items = Vec::with_capacity(count as usize);
    for _ in 0..count {
        items.push(read_value(cur, elem, level)?);
    }
    Ok(Value::Array(elem, items))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip() {
        for (id, row) in VALUE_TYPES.iter().enumerate() {
            assert_eq!(row.0.id(), id as u32);
            assert_eq!(ValueType::from_id(id as u32), Some(row.0));
        }
        assert_eq!(ValueType::from_id(13), None);
    }

    #[test]
    fn conversions_are_lossless_or_refused() {
        assert_eq!(Value::I32(-3).as_u64(), None);
        assert_eq!(Value::I64(7).as_u64(), Some(7));
        assert_eq!(Value::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(Value::F32(0.5).as_f64(), Some(0.5));
        assert_eq!(Value::U16(3).as_f64(), Some(3.0));
        assert_eq!(Value::String("x".into()).as_f64(), None);
        assert_eq!(Value::I8(-3).describe(), "i8 -3");
        assert_eq!(Value::Array(ValueType::U32, vec![]).describe(), "array of 0 u32");
    }
}

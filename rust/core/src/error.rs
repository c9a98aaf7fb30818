//! The one error type of the core crate. The binding crate maps each variant to a Python exception
//! in a single place, so every variant says which argument was wrong and what was expected.

use std::fmt;

/// Every failure the core can report. Messages name what was expected and what was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A shape, length or size that does not fit (maps to `ValueError`).
    Shape(String),
    /// A value that is not allowed: NaN/Inf, out of range (maps to `ValueError`).
    Value(String),
    /// A request for something this build or CPU cannot do (maps to `ValueError`).
    Unsupported(String),
    /// A GGUF file that is malformed, truncated or not what a model needs; the message names the key
    /// or tensor at fault (maps to `oxibonsai.GGUFError`).
    Gguf(String),
    /// A path that does not exist (maps to `FileNotFoundError`).
    NotFound(String),
    /// Any other operating-system failure while reading a file (maps to `OSError`).
    Io(String),
    /// The waiting queue already holds as many requests as it may (maps to `oxibonsai.QueueFull`).
    QueueFull(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Shape(msg)
            | Error::Value(msg)
            | Error::Unsupported(msg)
            | Error::Gguf(msg)
            | Error::NotFound(msg)
            | Error::Io(msg)
            | Error::QueueFull(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for Error {}

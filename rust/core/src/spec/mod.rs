//! Speculative decoding's proposers: cheap guesses of a request's next tokens, which one forward pass
//! of the model then checks together (each drafted token's row gives the logits of the token after
//! it). The scheduler asks for drafts while it plans a decode ([`crate::sched`]); the engine samples
//! the rows in order and keeps the drafts its own draws agree with, so what comes out is what
//! decoding one token at a time would give. Proposers never see logits or touch the KV cache.
//!
//! - [`ngram`]: prompt lookup (vLLM's `ngram` method): the tokens that followed the latest earlier
//!   occurrence of the request's last few tokens.
//! - [`acceptance`]: how many drafts pay for their rows, from how often a request's drafts are kept.

pub mod acceptance;
pub mod ngram;

pub use acceptance::{row_threshold, worth_drafting, Acceptance};
pub use ngram::{propose, NgramConfig};

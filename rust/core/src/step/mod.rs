//! The seam between planning a step and computing it. The scheduler ([`crate::sched`]) decides which
//! tokens of which sequences run ([`StepItem`]s); a runner computes them. The native CPU runner
//! ([`crate::model::ModelRunner`]) takes the items directly; any other runner (the torch one in
//! Python) takes a [`StepPlan`]: flat arrays in the shape of vLLM's attention metadata (token ids,
//! positions, the KV slot of every token, block tables, query offsets, logits rows) plus the tier
//! copies the step needs first. Nothing here runs a model or allocates blocks.

mod plan;

pub use plan::{StepPlan, TierCopies};

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// One entry of a step: compute `tokens` at the end of sequence `seq`, append all but the last
/// `drafts` of them (speculative decoding's drafted tokens: their KV is written into the blocks the
/// sequence reserved, and recorded only once accepted) and return the requested logits.
pub struct StepItem<'a> {
    pub seq: u64,
    pub tokens: &'a [u32],
    pub logits: Logits,
    pub drafts: usize,
}

impl<'a> StepItem<'a> {
    /// An item that appends every token it computes.
    pub fn new(seq: u64, tokens: &'a [u32], logits: Logits) -> StepItem<'a> {
        StepItem { seq, tokens, logits, drafts: 0 }
    }

    /// The tokens the step records in the sequence: all but the drafts.
    pub fn recorded(&self) -> &'a [u32] {
        &self.tokens[..self.tokens.len() - self.drafts]
    }
}

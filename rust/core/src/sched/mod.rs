//! The continuous-batching scheduler: which requests run in the next forward pass, and how many of
//! their tokens. Requests wait in a queue ordered by priority then arrival, with aging
//! ([`queue`]); each step ([`Scheduler::schedule`]) runs the decodes of running requests first, then
//! chunks of prompts still in prefill, then admits waiting requests while the token budget, the
//! sequence limit and the KV blocks allow, preempting the lowest-priority, most recently admitted
//! request when blocks run out. With a host tier, a step also prefetches the host-tier prefixes of the
//! requests next in line, so their copies run beside it (a request that would start by promoting its
//! prefix while others run starts a step later, on the prefetched blocks). Prefill, chunked prefill
//! and decode are all "n tokens of request r" ([`SchedulerOutput`]). The scheduler sees the KV cache only through a [`SequenceTable`]
//! (start, free, how many blocks a step needs); it never runs the model and never decides that a
//! request is finished: the engine samples, calls [`Scheduler::update`], and calls
//! [`Scheduler::finish`] on stop tokens, stop strings or length. A runner on an asynchronous device
//! may have the step after the pending one planned before the pending step's tokens are known, when
//! it would be one decode of every running request ([`Scheduler::schedule_ahead`], [`ahead`]).
//! With speculative decoding, decodes carry drafted tokens from what the step leaves ([`drafts`]).
//!
//! [`SequenceTable`]: crate::kv::SequenceTable

mod ahead;
#[cfg(test)]
mod ahead_tests;
mod config;
mod drafts;
#[cfg(test)]
mod drafts_tests;
mod output;
#[cfg(test)]
mod prompt_logits_tests;
mod queue;
mod request;
mod running;
mod scheduler;
mod slab;
mod step;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;

pub use config::{Policy, SchedulerConfig};
pub use output::{ScheduledItem, SchedulerOutput, SchedulerStats};
pub use queue::WaitingQueue;
pub use request::Request;
pub use scheduler::Scheduler;
pub use step::{LogitRows, PromptRows};

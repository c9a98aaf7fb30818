//! The scheduler's settings and their validation.

use crate::error::{Error, Result};
use crate::spec::NgramConfig;

/// How the next waiting request is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The head of the queue: best priority, then earliest arrival (with aging).
    Priority,
    /// Among the first [`LONGEST_PREFIX_WINDOW`] waiting requests in queue order, the one with the
    /// most cached prompt tokens (ties: queue order), so requests sharing a prefix run together.
    LongestPrefix,
}

/// How many waiting requests the longest-prefix policy looks at.
pub const LONGEST_PREFIX_WINDOW: usize = 64;

/// Most waiting requests whose host-tier prefixes one step prefetches.
pub const PREFETCH_WINDOW: usize = 4;

impl Policy {
    pub fn parse(name: &str) -> Result<Policy> {
        match name {
            "priority" | "fcfs" => Ok(Policy::Priority),
            "longest_prefix" | "lpm" => Ok(Policy::LongestPrefix),
            _ => Err(Error::Value(format!("policy must be 'priority' or 'longest_prefix', got {name:?}"))),
        }
    }
}

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most requests running at once.
    pub max_num_seqs: usize,
    /// Most tokens in one step (decodes and prefill chunks together).
    pub max_num_batched_tokens: usize,
    /// Most requests waiting; a new one beyond it is refused (`Error::QueueFull`). `None`: no limit.
    pub max_waiting: Option<usize>,
    /// A waiting request gains one priority level per this many steps waited.
    pub priority_aging_steps: u64,
    /// Split prompts longer than the remaining budget across steps.
    pub chunked_prefill: bool,
    pub policy: Policy,
    /// With a host tier: promote the host-tier prefixes of the waiting requests next in line while
    /// the current step runs, instead of in the step that starts them (see `Scheduler::schedule`).
    pub host_prefetch: bool,
    /// Speculative decoding: each decode of a request allowed drafts
    /// ([`Scheduler::allow_drafts`](super::Scheduler::allow_drafts)) also computes the tokens this
    /// proposer drafts after it, from the token budget and blocks the rest of the step leaves.
    pub speculation: Option<NgramConfig>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
            max_waiting: None,
            priority_aging_steps: 256,
            chunked_prefill: true,
            policy: Policy::Priority,
            host_prefetch: true,
            speculation: None,
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<()> {
        if self.max_num_seqs == 0 {
            return Err(Error::Value("max_num_seqs must be >= 1".into()));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(Error::Value(format!(
                "max_num_batched_tokens ({}) must be >= max_num_seqs ({}) so every running request can \
                 decode in each step",
                self.max_num_batched_tokens, self.max_num_seqs
            )));
        }
        if self.priority_aging_steps == 0 || self.priority_aging_steps > u32::MAX as u64 {
            return Err(Error::Value(format!(
                "priority_aging_steps must be in 1..={}, got {}",
                u32::MAX,
                self.priority_aging_steps
            )));
        }
        if let Some(spec) = &self.speculation {
            spec.validate()?;
        }
        Ok(())
    }
}

//! The scheduler's settings and their validation.

use crate::error::{Error, Result};
use crate::kv::BLOCK_TOKENS;

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
    /// Every piece of a prompt a step runs, and every rest it leaves (after a chunk or a cached
    /// prefix), spans at least this many tokens unless the prompt itself is shorter. 1 (the default)
    /// constrains nothing. A GPU runner whose attention sends one-row sequences to another kernel than
    /// longer ones sets 2, so every prompt row takes the same kernel whether the prompt was cached,
    /// chunked or run whole, and gives the same bits.
    pub min_prompt_piece: usize,
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
            min_prompt_piece: 1,
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
        if self.min_prompt_piece == 0 || self.min_prompt_piece > BLOCK_TOKENS.min(self.max_num_batched_tokens) {
            return Err(Error::Value(format!(
                "min_prompt_piece must be in 1..={}, got {}",
                BLOCK_TOKENS.min(self.max_num_batched_tokens),
                self.min_prompt_piece
            )));
        }
        if self.priority_aging_steps == 0 || self.priority_aging_steps > u32::MAX as u64 {
            return Err(Error::Value(format!(
                "priority_aging_steps must be in 1..={}, got {}",
                u32::MAX,
                self.priority_aging_steps
            )));
        }
        Ok(())
    }
}

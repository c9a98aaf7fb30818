//! What one `schedule()` call decides, and the scheduler's counters.

/// `num_tokens` tokens of request `request` (starting at token `start`, into KV sequence `seq`) run
/// in this step; `sample`: they complete the request's known tokens, so its logits are sampled.
/// `slot`: where the scheduler keeps the request (valid while the request runs on `seq`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledItem {
    pub request: u64,
    pub slot: u32,
    pub seq: u64,
    pub start: usize,
    pub num_tokens: usize,
    pub sample: bool,
}

/// One step: decodes of running requests, then their prefill chunks, then admissions.
#[derive(Clone, Debug, Default)]
pub struct SchedulerOutput {
    pub step: u64,
    pub items: Vec<ScheduledItem>,
    /// Requests preempted by this step, in order (back in the waiting queue).
    pub preempted: Vec<u64>,
    /// Scheduled tokens that are not decodes (prompt chunks, recomputation after preemption).
    pub num_prefill_tokens: usize,
}

impl SchedulerOutput {
    pub fn num_batched_tokens(&self) -> usize {
        self.items.iter().map(|i| i.num_tokens).sum()
    }

    pub fn num_sample(&self) -> usize {
        self.items.iter().filter(|i| i.sample).count()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// Counters since the scheduler was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub steps: u64,
    pub admitted: u64,
    pub preemptions: u64,
    pub finished: u64,
    pub aborted: u64,
    pub scheduled_tokens: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
}

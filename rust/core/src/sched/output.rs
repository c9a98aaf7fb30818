//! What one `schedule()` call decides, and the scheduler's counters.

use super::request::Request;

/// `num_tokens` tokens of request `request` (starting at token `start`, into KV sequence `seq`) run
/// in this step; `sample`: they complete the request's known tokens, so its logits are sampled;
/// `prompt_logits`: the request asked for its prompt's logprobs and some of these tokens are prompt
/// tokens whose logits score the next prompt token, so every token's logits are needed. `slot`:
/// where the scheduler keeps the request (valid while the request runs on `seq`); `drafts`: the last
/// `drafts` of the tokens are drafted, not yet the request's (speculative decoding: their rows'
/// logits check them, and only those accepted are recorded, by `Scheduler::update_drafted`). The blocks
/// the step's sequences grow by are reserved as one total ([`SchedulerOutput::new_blocks`]); each
/// sequence's share follows from its length. 40 bytes: a step's items are written by `schedule` and
/// read by the forward pass and `update`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledItem {
    pub request: u64,
    pub seq: u64,
    pub start: usize,
    pub num_tokens: usize,
    pub slot: u32,
    pub sample: bool,
    pub prompt_logits: bool,
    pub drafts: u16,
}

const _: () = assert!(std::mem::size_of::<ScheduledItem>() == 40);

/// One step: decodes of running requests, then their prefill chunks, then admissions.
#[derive(Clone, Debug, Default)]
pub struct SchedulerOutput {
    pub step: u64,
    pub items: Vec<ScheduledItem>,
    /// Requests preempted by this step, in order (back in the waiting queue).
    pub preempted: Vec<u64>,
    /// Scheduled tokens that are not decodes (prompt chunks, recomputation after preemption).
    pub num_prefill_tokens: usize,
    /// Drafted tokens among the scheduled ones (speculative decoding).
    pub num_draft_tokens: usize,
    /// Totals over `items`, kept as they are pushed.
    pub(super) num_batched_tokens: usize,
    pub(super) num_sample: usize,
    pub(super) new_blocks: usize,
}

impl SchedulerOutput {
    pub fn num_batched_tokens(&self) -> usize {
        self.num_batched_tokens
    }

    /// Items whose last row's logits are sampled.
    pub fn num_sample(&self) -> usize {
        self.num_sample
    }

    /// Blocks the step's sequences grow by, all items together.
    pub fn new_blocks(&self) -> usize {
        self.new_blocks
    }

    /// Adds `n` tokens of running request `r` (at `slot`), growing its sequence by `new_blocks`;
    /// `prompt_logits`: `r` wants its prompt's logprobs.
    #[inline(always)]
    pub(super) fn push(&mut self, r: &Request, slot: u32, n: usize, new_blocks: usize, prompt_logits: bool) {
        let sample = r.num_computed + n == r.tokens.len();
        let prompt_logits = prompt_logits && r.num_computed + 1 < r.prompt_len as usize;
        if !r.is_decoding() {
            self.num_prefill_tokens += n;
        }
        let seq = r.seq.expect("scheduled requests run");
        let start = r.num_computed;
        self.items.push(ScheduledItem {
            request: r.id,
            slot,
            seq,
            start,
            num_tokens: n,
            sample,
            prompt_logits,
            drafts: 0,
        });
        self.num_batched_tokens += n;
        self.num_sample += usize::from(sample);
        self.new_blocks += new_blocks;
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
    /// Drafted tokens scheduled (counted in `decode_tokens` too).
    pub draft_tokens: u64,
}

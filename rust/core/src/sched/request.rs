//! `Request`: what the scheduler knows of one request.

/// A request's tokens and its place in the queues. `tokens` is the prompt followed by every token
/// sampled so far; `num_computed` of them hold KV (0 while waiting).
///
/// Laid out by hand (`repr(C)`, 64-byte aligned): the fields every step reads and writes for each
/// running request come first and share one cache line, so a step over many running requests
/// touches one line of each; the queue fields, read only when a request is added, admitted,
/// preempted or removed, fill the second line.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub struct Request {
    pub id: u64,
    /// The request's KV sequence while it runs.
    pub seq: Option<u64>,
    pub num_computed: usize,
    pub tokens: Vec<u32>,
    /// The step that last scheduled it.
    pub scheduled_step: u64,
    // -- the second cache line: queue order --
    /// Waiting-queue order: `priority * priority_aging_steps + enqueue step` (aging built in).
    pub key: i128,
    /// Stamped each time the request starts running: the tie-break among running requests.
    pub admitted: u64,
    /// Add order, from 0: breaks ties in the waiting queue.
    pub arrival: u64,
    pub salt: Option<String>,
    /// Lower is served first.
    pub priority: i32,
    /// The prompt's length: `tokens[prompt_len..]` were sampled, each first computed alone in a
    /// decode step (a runner's attention may treat those rows as decode rows again on recompute).
    pub prompt_len: u32,
}

const _: () = assert!(std::mem::offset_of!(Request, scheduled_step) + 8 <= 64);
const _: () = assert!(std::mem::size_of::<Request>() == 128);

impl Request {
    /// Tokens not yet in the KV cache.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// In decode: only the last sampled token lacks KV.
    pub fn is_decoding(&self) -> bool {
        self.remaining() == 1 && self.num_computed > 0
    }

    /// The running set's order: better priority first, then earlier admission (`slot`: where the
    /// request lives in the scheduler, carried along).
    pub fn running_key(&self, slot: u32) -> (i32, u64, u32) {
        (self.priority, self.admitted, slot)
    }
}

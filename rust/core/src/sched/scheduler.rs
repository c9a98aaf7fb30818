//! `Scheduler`: the waiting queue, the running set, and the step rules (see the module doc of
//! [`crate::sched`]).

use crate::error::{Error, Result};
use crate::kv::{PrefixMatch, BLOCK_TOKENS};
use crate::model::{blocks_for, SequenceTable};

use super::config::{Policy, SchedulerConfig, LONGEST_PREFIX_WINDOW};
use super::output::{ScheduledItem, SchedulerOutput, SchedulerStats};
use super::queue::WaitingQueue;
use super::request::Request;
use super::running::RunningSet;
use super::slab::RequestSlab;

pub struct Scheduler {
    config: SchedulerConfig,
    pub(super) requests: RequestSlab,
    waiting: WaitingQueue,
    /// Running requests by `Request::running_key`.
    running: RunningSet,
    /// The running set's slots in order, refilled by every `schedule` (kept to reuse its memory).
    order: Vec<u32>,
    pub(super) step: u64,
    arrivals: u64,
    admissions: u64,
    /// The step whose output still awaits `update`.
    pub(super) pending: Option<u64>,
    stats: SchedulerStats,
}

/// What a step has handed out so far.
struct Budget {
    tokens: usize,
    /// New blocks promised to the step's items (allocated when the model runs them).
    reserved: usize,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Scheduler> {
        config.validate()?;
        Ok(Scheduler {
            config,
            requests: RequestSlab::default(),
            waiting: WaitingQueue::default(),
            running: RunningSet::default(),
            order: Vec::new(),
            step: 0,
            arrivals: 0,
            admissions: 0,
            pending: None,
            stats: SchedulerStats::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn request(&self, id: u64) -> Option<&Request> {
        self.requests.get(id)
    }

    /// Running request ids in admission order.
    pub fn running_ids(&self) -> Vec<u64> {
        let mut ids: Vec<&Request> = self.running.iter().map(|k| self.requests.at(k.2)).collect();
        ids.sort_by_key(|r| r.admitted);
        ids.iter().map(|r| r.id).collect()
    }

    /// Waiting request ids, best first.
    pub fn waiting_ids(&self) -> Vec<u64> {
        self.waiting.ids().collect()
    }

    /// Queues a request. Fails, changing nothing, on a known id, an empty prompt, or a full queue.
    pub fn add(&mut self, id: u64, prompt: Vec<u32>, priority: i32, salt: Option<String>) -> Result<()> {
        if self.requests.contains(id) {
            return Err(Error::Value(format!("request id {id} is already in the scheduler")));
        }
        if prompt.is_empty() {
            return Err(Error::Value("the prompt is empty: at least one token is needed".into()));
        }
        if let Some(limit) = self.config.max_waiting {
            if self.waiting.len() >= limit {
                return Err(Error::QueueFull(format!(
                    "the waiting queue is full ({limit} requests wait; max_waiting={limit}): retry later"
                )));
            }
        }
        let key = priority as i128 * self.config.priority_aging_steps as i128 + self.step as i128;
        let request = Request {
            id,
            tokens: prompt,
            priority,
            salt,
            arrival: self.arrivals,
            key,
            num_computed: 0,
            seq: None,
            admitted: 0,
            scheduled_step: 0,
        };
        self.arrivals += 1;
        self.waiting.push(key, request.arrival, id);
        self.requests.insert(request);
        Ok(())
    }

    /// Decides the next step (see the module doc); the caller runs it, then calls [`update`](Self::update).
    pub fn schedule(&mut self, kv: &mut SequenceTable) -> SchedulerOutput {
        self.step += 1;
        self.pending = Some(self.step);
        // Every item is a running or newly admitted request: at most this many.
        let items = Vec::with_capacity((self.running.len() + self.waiting.len()).min(self.config.max_num_seqs));
        let mut out = SchedulerOutput { step: self.step, items, preempted: Vec::new(), num_prefill_tokens: 0 };
        let mut budget = Budget { tokens: self.config.max_num_batched_tokens, reserved: 0 };
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend(self.running.iter().map(|k| k.2));
        for decode_pass in [true, false] {
            for &slot in &order {
                if budget.tokens == 0 {
                    break;
                }
                self.visit_running(slot, decode_pass, kv, &mut budget, &mut out);
            }
        }
        self.order = order;
        if out.preempted.is_empty() {
            self.admit(kv, &mut budget, &mut out);
        }
        self.stats.steps += 1;
        self.stats.scheduled_tokens += out.num_batched_tokens() as u64;
        out
    }

    fn visit_running(
        &mut self,
        slot: u32,
        decode_pass: bool,
        kv: &mut SequenceTable,
        budget: &mut Budget,
        out: &mut SchedulerOutput,
    ) {
        // A request preempted earlier in this step stays in `order` but has no sequence.
        let r = self.requests.at(slot);
        if r.seq.is_none() {
            return;
        }
        let remaining = r.remaining();
        if (remaining == 1) != decode_pass {
            return;
        }
        if !self.config.chunked_prefill && remaining > budget.tokens {
            return;
        }
        let n = remaining.min(budget.tokens);
        let seq = r.seq.expect("running");
        let need = kv.new_blocks_for(seq, n).expect("running requests have sequences");
        while need > kv.num_available_blocks().saturating_sub(budget.reserved) {
            let victim = self.pick_victim();
            self.preempt(victim, kv);
            out.preempted.push(self.requests.at(victim).id);
            if victim == slot {
                return;
            }
        }
        self.push_item(slot, n, budget, need, out);
    }

    /// The running request not yet scheduled this step with the worst priority, latest admitted.
    fn pick_victim(&self) -> u32 {
        let unscheduled = |k: &&(i32, u64, u32)| self.requests.at(k.2).scheduled_step != self.step;
        self.running.iter().rev().find(unscheduled).expect("the request being visited is unscheduled").2
    }

    /// Frees a running request's blocks and puts it back in the waiting queue (keeping its tokens,
    /// key and arrival), to be recomputed when it is admitted again.
    fn preempt(&mut self, slot: u32, kv: &mut SequenceTable) {
        let r = self.requests.at_mut(slot);
        self.running.remove(r.running_key(slot));
        if let Some(seq) = r.seq.take() {
            kv.free_sequence(seq).expect("running requests have sequences");
        }
        r.num_computed = 0;
        self.waiting.push(r.key, r.arrival, r.id);
        self.stats.preemptions += 1;
    }

    fn push_item(&mut self, slot: u32, n: usize, budget: &mut Budget, new_blocks: usize, out: &mut SchedulerOutput) {
        let r = self.requests.at_mut(slot);
        r.scheduled_step = self.step;
        if r.is_decoding() {
            self.stats.decode_tokens += n as u64;
        } else {
            self.stats.prefill_tokens += n as u64;
            out.num_prefill_tokens += n;
        }
        out.items.push(ScheduledItem {
            request: r.id,
            slot,
            seq: r.seq.expect("scheduled requests run"),
            start: r.num_computed,
            num_tokens: n,
            sample: r.num_computed + n == r.tokens.len(),
        });
        budget.tokens -= n;
        budget.reserved += new_blocks;
    }

    /// Starts waiting requests while the sequence limit, the token budget and the blocks allow.
    fn admit(&mut self, kv: &mut SequenceTable, budget: &mut Budget, out: &mut SchedulerOutput) {
        while self.running.len() < self.config.max_num_seqs && budget.tokens > 0 {
            let Some(id) = self.pick_waiting(kv) else { return };
            let slot = self.requests.slot_of(id).expect("waiting requests exist");
            let r = self.requests.at(slot);
            let m = kv.cached_prefix(&r.tokens, r.salt.as_deref());
            let remaining = r.tokens.len() - m.cached_tokens;
            if !self.config.chunked_prefill && remaining > budget.tokens {
                return;
            }
            let n = remaining.min(budget.tokens);
            let cached_blocks = m.cached_tokens / BLOCK_TOKENS;
            let new_blocks = blocks_for(m.cached_tokens + n) - cached_blocks;
            if new_blocks + m.idle_blocks > kv.num_available_blocks().saturating_sub(budget.reserved) {
                return;
            }
            self.start(slot, kv, m);
            self.push_item(slot, n, budget, new_blocks, out);
        }
    }

    fn pick_waiting(&self, kv: &SequenceTable) -> Option<u64> {
        match self.config.policy {
            Policy::Priority => self.waiting.first(),
            Policy::LongestPrefix => {
                let mut best: Option<(usize, u64)> = None;
                for id in self.waiting.ids().take(LONGEST_PREFIX_WINDOW) {
                    let r = self.requests.get(id).expect("waiting requests exist");
                    let cached = kv.cached_prefix(&r.tokens, r.salt.as_deref()).cached_tokens;
                    if best.is_none_or(|(c, _)| cached > c) {
                        best = Some((cached, id));
                    }
                }
                best.map(|(_, id)| id)
            }
        }
    }

    /// Moves a waiting request into the running set, on its cached prefix `m` (just looked up).
    fn start(&mut self, slot: u32, kv: &mut SequenceTable, m: PrefixMatch) {
        let r = self.requests.at_mut(slot);
        self.waiting.remove(r.key, r.arrival, r.id);
        let (seq, cached) = kv.add_sequence_found(&r.tokens, r.salt.as_deref(), m);
        r.seq = Some(seq);
        r.num_computed = cached;
        self.admissions += 1;
        r.admitted = self.admissions;
        self.running.insert(r.running_key(slot));
        self.stats.admitted += 1;
    }

    /// Ends a request (stop or length) and frees its blocks; false if unknown.
    pub fn finish(&mut self, id: u64, kv: &mut SequenceTable) -> bool {
        let found = self.remove(id, kv);
        self.stats.finished += found as u64;
        found
    }

    /// Like [`finish`](Self::finish), counted as an abort.
    pub fn abort(&mut self, id: u64, kv: &mut SequenceTable) -> bool {
        let found = self.remove(id, kv);
        self.stats.aborted += found as u64;
        found
    }

    /// Takes a request out of whichever queue holds it, freeing its blocks; false if unknown.
    fn remove(&mut self, id: u64, kv: &mut SequenceTable) -> bool {
        let Some(slot) = self.requests.slot_of(id) else { return false };
        let r = self.requests.remove(id).expect("found above");
        match r.seq {
            Some(seq) => {
                self.running.remove(r.running_key(slot));
                kv.free_sequence(seq).expect("running requests have sequences");
            }
            None => {
                self.waiting.remove(r.key, r.arrival, id);
            }
        }
        true
    }

    /// Checks the scheduler's invariants against the table it schedules over.
    pub fn check(&self, kv: &SequenceTable) -> Result<()> {
        let broken = |msg: String| Err(Error::Value(format!("scheduler invariant broken: {msg}")));
        if self.running.len() > self.config.max_num_seqs {
            return broken(format!("{} running > max_num_seqs", self.running.len()));
        }
        if self.running.len() + self.waiting.len() != self.requests.len() {
            return broken("a request is in neither or both of the queues".into());
        }
        for r in self.requests.values() {
            let slot = self.requests.slot_of(r.id).expect("every stored request is indexed");
            match r.seq {
                Some(seq) => {
                    if !self.running.contains(r.running_key(slot)) {
                        return broken(format!("request {} has a sequence but is not running", r.id));
                    }
                    let len = kv.sequence_len(seq)?;
                    if self.pending.is_none() && len != r.num_computed {
                        return broken(format!("request {}: {} computed but {len} in the cache", r.id, r.num_computed));
                    }
                }
                None if r.num_computed != 0 => return broken(format!("waiting request {} holds KV", r.id)),
                None => {}
            }
        }
        kv.check()
    }
}

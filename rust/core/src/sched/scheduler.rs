//! `Scheduler`: the waiting queue, the running set, and the step rules (see the module doc of
//! [`crate::sched`]).

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::kv::{blocks_for, PrefixMatch, SequenceTable, BLOCK_TOKENS, GENERATION_ROOM};

use super::config::{Policy, SchedulerConfig, LONGEST_PREFIX_WINDOW, PREFETCH_WINDOW};
use super::drafts::Draft;
use super::output::{SchedulerOutput, SchedulerStats};
use super::queue::WaitingQueue;
use super::request::Request;
use super::running::RunningSet;
use super::slab::RequestSlab;

pub struct Scheduler {
    pub(super) config: SchedulerConfig,
    pub(super) requests: RequestSlab,
    pub(super) waiting: WaitingQueue,
    /// Running requests by `Request::running_key`.
    pub(super) running: RunningSet,
    /// The running set's slots in order, and those of its requests in prefill, refilled by every
    /// `schedule` (kept to reuse their memory).
    order: Vec<u32>,
    prefills: Vec<u32>,
    pub(super) step: u64,
    arrivals: u64,
    admissions: u64,
    /// The step whose output still awaits `update`.
    pub(super) pending: Option<u64>,
    /// The step planned after `pending` before its tokens were known (`schedule_ahead`): it becomes
    /// `pending` when `pending` is recorded.
    pub(super) ahead: Option<u64>,
    /// The last request whose start was put off by a step while its host-tier prefix was prefetched
    /// (see `admit`): it is not put off twice in a row.
    deferred: Option<u64>,
    pub(super) stats: SchedulerStats,
    /// The requests that want their prompt's logprobs, each with how many top logprobs per token,
    /// until every prompt token's logits have been computed. They start without the prefix cache (a
    /// cached token's logits are never computed) and their prompt chunks return every row.
    pub(super) prompt_logprobs: HashMap<u64, usize>,
    /// The requests the proposer may draft for (`allow_drafts`), with their last drafts.
    pub(super) drafts: HashMap<u64, Draft>,
}

/// What a step has handed out so far.
pub(super) struct Budget {
    pub(super) tokens: usize,
    /// New blocks promised to the step's items (allocated when the model runs them).
    reserved: usize,
    /// The table's available blocks (free or evictable), read again whenever the step changes it.
    available: usize,
}

impl Budget {
    /// Blocks the step can still promise.
    pub(super) fn room(&self) -> usize {
        self.available.saturating_sub(self.reserved)
    }

    pub(super) fn take(&mut self, tokens: usize, blocks: usize) {
        self.tokens -= tokens;
        self.reserved += blocks;
    }
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
            prefills: Vec::new(),
            step: 0,
            arrivals: 0,
            admissions: 0,
            pending: None,
            ahead: None,
            deferred: None,
            stats: SchedulerStats::default(),
            prompt_logprobs: HashMap::new(),
            drafts: HashMap::new(),
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
    /// The prompt's list grows by every sampled token: it gets [`GENERATION_ROOM`] tokens of room
    /// here unless the caller allocated it with room already.
    pub fn add(&mut self, id: u64, mut prompt: Vec<u32>, priority: i32, salt: Option<String>) -> Result<()> {
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
        let prompt_len = u32::try_from(prompt.len())
            .map_err(|_| Error::Value(format!("the prompt has {} tokens, more than 2^32 - 1", prompt.len())))?;
        prompt.reserve(GENERATION_ROOM);
        let request = Request {
            id,
            seq: None,
            num_computed: 0,
            tokens: prompt,
            scheduled_step: 0,
            key,
            admitted: 0,
            arrival: self.arrivals,
            salt,
            priority,
            prompt_len,
        };
        self.arrivals += 1;
        self.waiting.push(key, request.arrival, id);
        self.requests.insert(request);
        Ok(())
    }

    /// Asks for the logprobs of waiting request `id`'s prompt tokens, with the `top` highest of each
    /// position: its prompt chunks return every row's logits ([`ScheduledItem::prompt_logits`],
    /// laid out by [`logit_rows`](Self::logit_rows)), and it starts without the prefix cache. Fails on
    /// a request that is not waiting or has run before.
    pub fn want_prompt_logprobs(&mut self, id: u64, top: usize) -> Result<()> {
        match self.requests.get(id) {
            Some(r) if r.seq.is_none() && r.tokens.len() == r.prompt_len as usize => {
                // A one-token prompt has no token to score (its only row is the first sampling row).
                if r.prompt_len > 1 {
                    self.prompt_logprobs.insert(id, top);
                }
                Ok(())
            }
            Some(_) => {
                Err(Error::Value(format!("request {id} has already run: ask for prompt logprobs when adding it")))
            }
            None => Err(Error::Value(format!("request id {id} is not in the scheduler"))),
        }
    }

    /// Decides the next step (see the module doc); the caller runs it, then calls [`update`](Self::update).
    /// A step planned ahead ([`schedule_ahead`](Self::schedule_ahead)) and not recorded is forgotten
    /// (an engine drops one only together with its requests, whose blocks that frees).
    pub fn schedule(&mut self, kv: &mut SequenceTable) -> SchedulerOutput {
        self.step += 1;
        self.pending = Some(self.step);
        self.ahead = None;
        // Every item is a running or newly admitted request: at most this many.
        let items = Vec::with_capacity((self.running.len() + self.waiting.len()).min(self.config.max_num_seqs));
        let mut out = SchedulerOutput { step: self.step, items, ..Default::default() };
        let mut budget =
            Budget { tokens: self.config.max_num_batched_tokens, reserved: 0, available: kv.num_available_blocks() };
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend(self.running.iter().map(|k| k.2));
        // Decodes first, in running order; the rest (prompt chunks) are set aside for a second visit.
        let mut prefills = std::mem::take(&mut self.prefills);
        prefills.clear();
        for &slot in &order {
            if budget.tokens == 0 {
                break;
            }
            match self.requests.at(slot) {
                // Preempted earlier in this step.
                r if r.seq.is_none() => {}
                r if r.remaining() == 1 => self.visit_running(slot, kv, &mut budget, &mut out),
                _ => prefills.push(slot),
            }
        }
        let decodes = out.items.len();
        for &slot in &prefills {
            if budget.tokens == 0 {
                break;
            }
            self.visit_running(slot, kv, &mut budget, &mut out);
        }
        self.order = order;
        self.prefills = prefills;
        if out.preempted.is_empty() {
            self.admit(kv, &mut budget, &mut out);
            if !self.drafts.is_empty() {
                self.add_drafts(decodes, &mut budget, &mut out);
            }
            // Not in an empty step: there is no forward pass to overlap, and an engine runs no plan
            // (so no copies) for it.
            if self.config.host_prefetch && !out.items.is_empty() {
                self.prefetch(kv, &mut budget);
            }
        }
        self.stats.steps += 1;
        self.stats.scheduled_tokens += out.num_batched_tokens as u64;
        self.stats.prefill_tokens += out.num_prefill_tokens as u64;
        self.stats.decode_tokens += (out.num_batched_tokens - out.num_prefill_tokens) as u64;
        self.stats.draft_tokens += out.num_draft_tokens as u64;
        out
    }

    /// Schedules what it can of a running request's remaining tokens, preempting others (or itself)
    /// when the blocks run short. Inlined into both of `schedule`'s loops: it runs for every running
    /// request every step.
    #[inline(always)]
    fn visit_running(&mut self, slot: u32, kv: &mut SequenceTable, budget: &mut Budget, out: &mut SchedulerOutput) {
        let step = self.step;
        let r = self.requests.at_mut(slot);
        // A request preempted earlier in this step stays in `order` but has no sequence.
        let Some(seq) = r.seq else { return };
        let remaining = r.remaining();
        if !self.config.chunked_prefill && remaining > budget.tokens {
            return;
        }
        let n = remaining.min(budget.tokens);
        // Between steps a running request's sequence holds exactly its computed tokens' blocks.
        let need = blocks_for(r.num_computed + n) - blocks_for(r.num_computed);
        debug_assert_eq!(Ok(need), kv.new_blocks_for(seq, n), "request {} and its sequence disagree", r.id);
        let wants = &self.prompt_logprobs;
        if need <= budget.room() {
            return schedule_item(step, r, slot, n, need, wants, budget, out);
        }
        if self.make_room(slot, need, kv, budget, out) {
            schedule_item(step, self.requests.at_mut(slot), slot, n, need, &self.prompt_logprobs, budget, out);
        }
    }

    /// Preempts running requests not yet scheduled this step, worst first, until `need` blocks are
    /// available; false if that preempted the request at `slot` itself.
    #[cold]
    #[inline(never)]
    fn make_room(
        &mut self,
        slot: u32,
        need: usize,
        kv: &mut SequenceTable,
        budget: &mut Budget,
        out: &mut SchedulerOutput,
    ) -> bool {
        while need > budget.room() {
            let victim = self.pick_victim();
            self.preempt(victim, kv);
            budget.available = kv.num_available_blocks();
            out.preempted.push(self.requests.at(victim).id);
            if victim == slot {
                return false;
            }
        }
        true
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

    /// Starts waiting requests while the sequence limit, the token budget and the blocks allow.
    fn admit(&mut self, kv: &mut SequenceTable, budget: &mut Budget, out: &mut SchedulerOutput) {
        while self.running.len() < self.config.max_num_seqs && budget.tokens > 0 {
            let Some(id) = self.pick_waiting(kv) else { return };
            let slot = self.requests.slot_of(id).expect("waiting requests exist");
            let r = self.requests.at(slot);
            let m = if self.prompt_logprobs.contains_key(&id) {
                PrefixMatch::default()
            } else {
                kv.cached_prefix(&r.tokens, r.salt.as_deref())
            };
            let remaining = r.tokens.len() - m.cached_tokens;
            if !self.config.chunked_prefill && remaining > budget.tokens {
                return;
            }
            if self.defer_for_prefetch(id, &m, kv, budget, out) {
                return;
            }
            let n = remaining.min(budget.tokens);
            let cached_blocks = m.cached_tokens / BLOCK_TOKENS;
            let new_blocks = blocks_for(m.cached_tokens + n) - cached_blocks;
            // Acquiring takes idle cached blocks out of the available ones, and promotes host blocks
            // into new device blocks.
            if new_blocks + m.idle_blocks + m.host_blocks.len() > budget.room() {
                return;
            }
            self.start(slot, kv, m);
            budget.available = kv.num_available_blocks();
            let wants = &self.prompt_logprobs;
            schedule_item(self.step, self.requests.at_mut(slot), slot, n, new_blocks, wants, budget, out);
        }
    }

    /// Puts off the start of request `id`, whose cached prefix `m` continues in the host tier, by one
    /// step when the step already computes other requests: its host blocks are prefetched now (all of
    /// them, into blocks the step leaves spare), so their copies run beside this step instead of
    /// holding up every request of the step that promotes them, and it starts next step on device
    /// blocks. Its own first token comes later by what this step takes beyond the copy, if anything
    /// (the next step waits for what is left of the copy). Admission stops behind it for this step
    /// (the blocks it needs stay spare). Never twice in a row for a request.
    fn defer_for_prefetch(
        &mut self,
        id: u64,
        m: &PrefixMatch,
        kv: &mut SequenceTable,
        budget: &mut Budget,
        out: &SchedulerOutput,
    ) -> bool {
        let worth = self.config.host_prefetch && !m.host_blocks.is_empty() && !out.items.is_empty();
        if !worth || self.deferred == Some(id) {
            return false;
        }
        let spare = self.prefetch_room(budget);
        if m.host_blocks.len() + m.idle_blocks > spare {
            return false;
        }
        kv.prefetch_found(m.clone(), spare);
        budget.available = kv.num_available_blocks();
        self.deferred = Some(id);
        true
    }

    /// Promotes the host-tier prefixes of the waiting requests next in queue order (as many as could
    /// start next step, at most [`PREFETCH_WINDOW`]) into idle device blocks: their copies run beside
    /// this step's forward pass instead of holding up the step that starts them. Leaves available the
    /// blocks this step reserved and one per running request (its next step's growth), so a prefetch
    /// never preempts and rarely evicts what the next step needs.
    fn prefetch(&self, kv: &mut SequenceTable, budget: &mut Budget) {
        let starts = self.config.max_num_seqs - self.running.len();
        for id in self.waiting.ids().take(starts.min(PREFETCH_WINDOW)) {
            let spare = self.prefetch_room(budget);
            if spare == 0 {
                return;
            }
            let r = self.requests.get(id).expect("waiting requests exist");
            if self.prompt_logprobs.contains_key(&id) {
                continue; // it starts without the cache
            }
            if kv.prefetch(&r.tokens, r.salt.as_deref(), spare) > 0 {
                budget.available = kv.num_available_blocks();
            }
        }
    }

    /// Blocks a prefetch may take: what the step leaves available, less one per running request (its
    /// next step's growth).
    fn prefetch_room(&self, budget: &Budget) -> usize {
        budget.room().saturating_sub(self.running.len())
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
        self.prompt_logprobs.remove(&id);
        self.drafts.remove(&id);
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
        if let Some(id) = self.drafts.keys().find(|&&id| !self.requests.contains(id)) {
            return broken(format!("request {id} may be drafted for but is not in the scheduler"));
        }
        kv.check_holding(self.pending.is_some())
    }
}

/// Puts `n` tokens of request `r` (at `slot`), growing its sequence by `new_blocks`, into step
/// `step`'s output and budget; `wants`: the requests that want their prompt's logprobs.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn schedule_item(
    step: u64,
    r: &mut Request,
    slot: u32,
    n: usize,
    new_blocks: usize,
    wants: &HashMap<u64, usize>,
    budget: &mut Budget,
    out: &mut SchedulerOutput,
) {
    r.scheduled_step = step;
    let prompt_logits = !wants.is_empty() && wants.contains_key(&r.id);
    out.push(r, slot, n, new_blocks, prompt_logits);
    budget.take(n, new_blocks);
}

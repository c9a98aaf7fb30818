//! Asynchronous scheduling: planning the step after the pending one before that step's sampled tokens
//! are known, so a runner on an asynchronous device (a GPU) can queue it behind the pending one and the
//! device never waits for the host between two decode steps.
//!
//! Only a step that is all decodes is planned ahead: every running request samples in the pending step
//! and no waiting request could start, so the next step would be one token of each, the token the
//! pending step samples. Those tokens are not known yet: the plan carries 0 in their place and the
//! runner feeds them on its device from the pending step's draws (the step ahead's items are the
//! pending step's sampling items in order, less the requests skipped or ended since; the engine maps
//! each to its draw by request). The step ahead is recorded after the pending one
//! (`update` of the pending step makes it the pending step), when its tokens are in the requests'
//! lists. A request that ends with the pending step's token (a stop token or string, which the engine
//! learns only then) has computed one token too many in the step ahead: the engine finishes it before
//! recording that step, which skips it, and its blocks (the extra one included) are freed with it; a
//! request the engine knows will end (its length) is skipped when the step is planned.
//!
//! A step planned ahead is planned while the pending one may still run on the device. It admits and
//! prefetches nothing, so it promotes no block: its only tier copies are demotions of idle cached
//! blocks that its reservation evicts, whose K/V are complete (cached only once recorded) and which
//! the pending step neither reads nor writes; the blocks of requests ended meanwhile that it reuses
//! are written after the pending step, on the same stream.

use crate::kv::{blocks_for, SequenceTable};

use super::output::{ScheduledItem, SchedulerOutput};
use super::scheduler::Scheduler;

impl Scheduler {
    /// The step after `prev`, the pending step (planned with `plan` and not yet recorded), when it
    /// would decode one token of every running request: each request sampling in `prev`, except those
    /// in `skip`, decodes the token it samples there. None, changing nothing, unless no waiting request
    /// could start (none waits, or every sequence slot is taken: one that a request ending in `prev`
    /// frees is filled a step later), every running request samples in `prev` with no drafts, no step
    /// is already planned ahead, and the new blocks are available without preempting (a step ahead
    /// never preempts).
    pub fn schedule_ahead(
        &mut self,
        prev: &SchedulerOutput,
        kv: &SequenceTable,
        skip: &[u64],
    ) -> Option<SchedulerOutput> {
        // A waiting request could start in the next step, unless every sequence slot is taken.
        let could_start = !self.waiting.is_empty() && self.running.len() < self.config.max_num_seqs;
        if self.pending != Some(prev.step) || self.ahead.is_some() || could_start {
            return None;
        }
        let live = |it: &&ScheduledItem| self.requests.running_at(it.slot, it.request, it.seq).is_some();
        if prev.items.iter().filter(live).any(|it| !it.sample || it.drafts > 0)
            || prev.items.iter().filter(live).count() != self.running.len()
        {
            return None;
        }
        let mut out = SchedulerOutput { step: self.step + 1, ..Default::default() };
        for it in prev.items.iter().filter(live).filter(|it| !skip.contains(&it.request)) {
            let start = it.start + it.num_tokens;
            out.items.push(ScheduledItem {
                start,
                num_tokens: 1,
                sample: true,
                prompt_logits: false,
                drafts: 0,
                ..*it
            });
            out.num_batched_tokens += 1;
            out.num_sample += 1;
            out.new_blocks += blocks_for(start + 1) - blocks_for(start);
        }
        let fits =
            out.num_batched_tokens <= self.config.max_num_batched_tokens && out.new_blocks <= kv.num_available_blocks();
        if out.items.is_empty() || !fits {
            return None;
        }
        self.step = out.step;
        self.ahead = Some(out.step);
        for it in &out.items {
            self.requests.at_mut(it.slot).scheduled_step = out.step;
        }
        self.stats.steps += 1;
        self.stats.scheduled_tokens += out.num_batched_tokens as u64;
        self.stats.decode_tokens += out.num_batched_tokens as u64;
        Some(out)
    }

    /// The step planned ahead of the pending one, if any.
    pub fn ahead(&self) -> Option<u64> {
        self.ahead
    }
}

//! Running a planned step and recording it: the model's work for a [`SchedulerOutput`]
//! ([`Scheduler::step_items`]), where its logits rows are ([`Scheduler::logit_rows`]), the
//! ledger's version of a forward pass
//! ([`Scheduler::advance_ledger`]), and [`Scheduler::update`]. Items of requests finished (or
//! preempted) since `schedule` are skipped everywhere.

use crate::error::{Error, Result};
use crate::kv::SequenceTable;
use crate::step::{Logits, StepItem, StepPlan};

use super::output::{ScheduledItem, SchedulerOutput};
use super::request::Request;
use super::scheduler::Scheduler;

/// A step's logits rows: `total` of them, `sample[i]` the row sampling item `i` samples from, and
/// the prompt rows of the requests that asked for their prompt's logprobs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogitRows {
    pub total: usize,
    pub sample: Vec<usize>,
    pub prompt: Vec<PromptRows>,
}

/// Rows `first_row..first_row + targets.len()` hold the logits at request `request`'s prompt
/// positions `start..`; the row at position `p` scores prompt token `p + 1` (`targets`), with the
/// `top` highest logprobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptRows {
    pub request: u64,
    pub start: usize,
    pub first_row: usize,
    pub targets: Vec<u32>,
    pub top: usize,
}

/// The token a plan carries for one that the step before it samples (a step planned ahead).
const PLACEHOLDER: [u32; 1] = [0];

impl Scheduler {
    /// An item's request, if it still runs on the item's sequence.
    pub(super) fn item_request(&self, it: &ScheduledItem) -> Option<&Request> {
        self.requests.running_at(it.slot, it.request, it.seq)
    }

    /// An item's tokens, if its request still runs on the item's sequence; for an item of a step
    /// planned ahead whose token is not sampled yet, [`PLACEHOLDER`]; for a drafted item, its token
    /// and drafts.
    fn item_tokens(&self, it: &ScheduledItem) -> Option<&[u32]> {
        let r = self.item_request(it)?;
        if it.drafts > 0 {
            return self.drafted_tokens(it);
        }
        let tokens = r.tokens.get(it.start..it.start + it.num_tokens);
        debug_assert!(tokens.is_some() || (it.num_tokens == 1 && it.start == r.tokens.len()));
        Some(tokens.unwrap_or(&PLACEHOLDER))
    }

    /// The model's work for `out` (the latest step's output): each item's tokens and which rows'
    /// logits are needed (the last of a sampling item; every row of a `prompt_logits` or drafted item).
    pub fn step_items(&self, out: &SchedulerOutput) -> Result<Vec<StepItem<'_>>> {
        self.check_pending(out)?;
        Ok(out.items.iter().filter_map(|it| self.step_item(it)).collect())
    }

    /// An item as the model's work, if its request still runs on the item's sequence.
    fn step_item(&self, it: &ScheduledItem) -> Option<StepItem<'_>> {
        let tokens = self.item_tokens(it)?;
        let logits = match (it.prompt_logits || it.drafts > 0, it.sample) {
            (true, _) => Logits::All,
            (false, true) => Logits::Last,
            (false, false) => Logits::None,
        };
        Some(StepItem { seq: it.seq, tokens, logits, drafts: it.drafts as usize })
    }

    /// Where the logits rows of `out`'s step (the latest schedule's, not yet updated) come from, in
    /// the order a runner returns them ([`step_items`](Self::step_items), or the plan's
    /// `logits_indices`): the sampling rows, and the prompt rows of the requests that want their
    /// prompt's logprobs. A drafted item's rows are all sampling rows, in order.
    pub fn logit_rows(&self, out: &SchedulerOutput) -> LogitRows {
        let mut rows = LogitRows::default();
        let mut next = 0;
        for it in &out.items {
            let Some(r) = self.item_request(it) else { continue };
            if it.prompt_logits {
                // Row p scores prompt token p + 1; the prompt's last row is its first sampling row.
                let count = it.num_tokens.min((r.prompt_len as usize - 1).saturating_sub(it.start));
                rows.prompt.push(PromptRows {
                    request: it.request,
                    start: it.start,
                    first_row: next,
                    targets: r.tokens[it.start + 1..it.start + 1 + count].to_vec(),
                    top: self.prompt_logprobs.get(&it.request).copied().unwrap_or(0),
                });
                next += it.num_tokens;
                if it.sample {
                    rows.sample.push(next - 1);
                }
            } else if it.sample {
                // A drafted item samples from every row: its token's, then each draft's.
                let count = 1 + it.drafts as usize;
                rows.sample.extend(next..next + count);
                next += count;
            }
        }
        rows.total = next;
        rows
    }

    /// What a forward pass does to a model-free table: grow the block tables for the step's tokens
    /// (the blocks `schedule` reserved for them), then record the tokens. Only the latest step's
    /// output is accepted: its reservation still holds, as nothing but `finish`/`abort` (which free
    /// blocks) can come between.
    pub fn advance_ledger(&self, out: &SchedulerOutput, kv: &mut SequenceTable) -> Result<()> {
        self.check_pending(out)?;
        let steps = out.items.iter().filter_map(|it| Some((it.seq, self.item_tokens(it)?, it.drafts as usize)));
        kv.advance_planned(out.new_blocks(), steps)?;
        // No memory to copy: the copies are done as soon as they are made.
        kv.take_copies();
        kv.complete_copies()
    }

    /// A step for a runner other than the native one: grows the block tables for `out`'s tokens (the
    /// blocks `schedule` reserved) and returns the plan, with every tier copy recorded since the last
    /// plan. [`commit_plan`](Self::commit_plan) records the tokens once the runner computed them.
    /// A step planned ahead ([`schedule_ahead`](Self::schedule_ahead)) is planned the same way,
    /// before the pending step is recorded: its tokens follow the pending step's.
    pub fn plan(&self, out: &SchedulerOutput, kv: &mut SequenceTable) -> Result<StepPlan> {
        if self.ahead != Some(out.step) {
            self.check_pending(out)?;
        }
        // The items whose request still runs, with their prompt lengths, starts and block growth.
        let (mut items, mut prompt_lens, mut starts, mut growth) = (vec![], vec![], vec![], vec![]);
        for it in &out.items {
            let (Some(r), Some(item)) = (self.item_request(it), self.step_item(it)) else { continue };
            items.push(item);
            prompt_lens.push(r.prompt_len as usize);
            starts.push(it.start);
            // An item starting before its sequence's end is refused by `build_at` below.
            growth.push((it.seq, (it.start + it.num_tokens).saturating_sub(kv.sequence_len(it.seq)?)));
        }
        kv.reserve(&growth)?;
        let mut plan = StepPlan::build_at(&items, &starts, &prompt_lens, kv)?;
        plan.copies = kv.take_copies();
        Ok(plan)
    }

    /// The sequences' side of a step [`plan`](Self::plan)ned and computed: every item's tokens now
    /// hold KV, and the plan's copies are complete. Call before [`update`](Self::update).
    pub fn commit_plan(&self, out: &SchedulerOutput, kv: &mut SequenceTable) -> Result<()> {
        self.check_pending(out)?;
        for it in &out.items {
            if let Some(tokens) = self.item_tokens(it) {
                kv.append(it.seq, &tokens[..tokens.len() - it.drafts as usize])?;
            }
        }
        kv.complete_copies()
    }

    /// Fails unless `out` is the output of the latest `schedule` and not yet recorded.
    pub(super) fn check_pending(&self, out: &SchedulerOutput) -> Result<()> {
        if self.pending == Some(out.step) {
            return Ok(());
        }
        Err(Error::Value(format!(
            "this needs the output of the latest schedule() (step {}) before its update(), got step {}",
            self.step, out.step
        )))
    }

    /// Records that the step ran: every item's tokens now hold KV, and each sampling item gets its
    /// sampled token (`sampled` in item order). Fails, changing nothing, on a stale output or the
    /// wrong number of tokens.
    /// A step with drafts is recorded by [`update_drafted`](Self::update_drafted).
    pub fn update(&mut self, out: &SchedulerOutput, sampled: &[u32]) -> Result<()> {
        self.check_pending(out)?;
        if out.num_draft_tokens > 0 {
            return Err(Error::Value("this step has drafts: record it with update_drafted()".into()));
        }
        if sampled.len() != out.num_sample() {
            return Err(Error::Value(format!(
                "update() got {} sampled tokens for {} sampling items",
                sampled.len(),
                out.num_sample()
            )));
        }
        self.record(out, sampled, &[]);
        Ok(())
    }

    /// `update`'s bookkeeping, checked before: each item's computed tokens less its rejected drafts
    /// now hold KV, and each sampling item `i` appends its `accepted[i] + 1` tokens of `sampled` (one
    /// where `accepted` is empty).
    pub(super) fn record(&mut self, out: &SchedulerOutput, sampled: &[u32], accepted: &[usize]) {
        self.pending = self.ahead.take();
        let (mut at, mut k) = (0, 0);
        for it in &out.items {
            let taken = if it.sample { accepted.get(k).map_or(1, |a| a + 1) } else { 0 };
            let tokens = &sampled[at..at + taken];
            (at, k) = (at + taken, k + usize::from(it.sample));
            if it.sample && it.drafts == 0 && !self.drafts.is_empty() {
                self.score_shadow(it.request, tokens[0]);
            }
            let Some(r) = self.requests.running_at_mut(it.slot, it.request, it.seq) else { continue };
            // A drafted item's KV holds its token and the drafts kept: all its tokens but the last.
            r.num_computed += if it.drafts > 0 { taken } else { it.num_tokens };
            if it.prompt_logits && r.num_computed + 1 >= r.prompt_len as usize {
                self.prompt_logprobs.remove(&it.request);
            }
            r.tokens.extend_from_slice(tokens);
        }
    }
}

//! Speculative decoding in the scheduler: a running request that may be drafted for
//! ([`Scheduler::allow_drafts`]) decodes its next token together with tokens the proposer drafts
//! after it ([`SchedulerConfig::speculation`]), from the token budget and blocks the step leaves
//! once it has scheduled everything else (decodes, prompt chunks, admissions): drafts never
//! preempt, delay or displace other work. With an adaptive proposer a request drafts only as many
//! tokens as its acceptance so far says will pay for their rows in this step ([`spec::acceptance`]).
//! The forward pass computes a drafted item's tokens and records only its first (the token sampled
//! last step) in the sequence; the engine samples the item's rows in order, keeping each draft its
//! draw equals, and [`Scheduler::update_drafted`] records the kept drafts' KV (their rows already
//! wrote it), gives back the blocks only rejected drafts took, and appends the draws.
//!
//! [`SchedulerConfig::speculation`]: super::SchedulerConfig::speculation

use crate::error::{Error, Result};
use crate::kv::{blocks_for, SequenceTable, BLOCK_TOKENS};
use crate::spec::{self, Acceptance};

use super::output::{ScheduledItem, SchedulerOutput};
use super::scheduler::{Budget, Scheduler};

/// What drafting knows of one request.
#[derive(Default)]
pub(super) struct Draft {
    /// The request's tokens (prompt and output) never pass this many: nothing is drafted beyond.
    limit: usize,
    /// The pending step's tokens for the request when it drafted: the token sampled last, then the
    /// drafts (what the forward pass computes).
    pub(super) tokens: Vec<u32>,
    /// How often its drafts were kept, or would have been.
    acceptance: Acceptance,
    /// The first token the proposer drafted in a step where no draft paid (so none ran): the
    /// token sampled there tells whether it would have been kept, evidence that costs no row.
    shadow: Option<u32>,
}

impl Scheduler {
    /// Lets the proposer draft tokens for request `id`, whose tokens (prompt and output) will never
    /// pass `limit` (its prompt and `max_tokens`, within the context): drafts stop there. Without
    /// speculation in the config this does nothing. Fails on an unknown id.
    pub fn allow_drafts(&mut self, id: u64, limit: usize) -> Result<()> {
        if !self.requests.contains(id) {
            return Err(Error::Value(format!("request id {id} is not in the scheduler")));
        }
        if self.config.speculation.is_some() {
            self.drafts.insert(id, Draft { limit, ..Draft::default() });
        }
        Ok(())
    }

    /// Extends the decodes among `out.items[..decodes]` by drafts, in order, while the tokens and
    /// blocks the step has not handed out last.
    pub(super) fn add_drafts(&mut self, decodes: usize, budget: &mut Budget, out: &mut SchedulerOutput) {
        let Some(config) = self.config.speculation else { return };
        let threshold = spec::row_threshold(decodes, out.num_batched_tokens);
        for i in 0..decodes {
            if budget.tokens == 0 {
                return;
            }
            let it = &mut out.items[i];
            let r = self.requests.at(it.slot);
            let Some(draft) = self.drafts.get_mut(&it.request) else { continue };
            if it.num_tokens != 1 || !it.sample {
                continue;
            }
            // Tokens the blocks it holds or is promised, and those still available, have room for.
            let end = it.start + 1;
            let room = (blocks_for(end) + budget.room()) * BLOCK_TOKENS - end;
            let most = config.num_tokens.min(budget.tokens).min(draft.limit.saturating_sub(r.tokens.len())).min(room);
            let limit =
                if config.adaptive { spec::worth_drafting(draft.acceptance.rate(), threshold, most) } else { most };
            draft.tokens.clear();
            draft.tokens.push(r.tokens[it.start]);
            spec::propose(&r.tokens, &config, limit.max(usize::from(most > 0)), &mut draft.tokens);
            draft.shadow = None;
            if limit == 0 {
                draft.shadow = draft.tokens.get(1).copied();
                draft.tokens.truncate(1);
            }
            let drafted = draft.tokens.len() - 1;
            if drafted == 0 {
                continue;
            }
            let blocks = blocks_for(end + drafted) - blocks_for(end);
            extend(it, drafted);
            out.num_batched_tokens += drafted;
            out.num_draft_tokens += drafted;
            out.new_blocks += blocks;
            budget.take(drafted, blocks);
        }
    }

    /// The tokens a drafted item computes (the last sampled one, then the drafts), if its request
    /// still runs.
    pub(super) fn drafted_tokens(&self, it: &ScheduledItem) -> Option<&[u32]> {
        self.drafts.get(&it.request).map(|d| &d.tokens[..]).filter(|t| t.len() == it.num_tokens)
    }

    /// The drafts of `out`'s sampling items in item order (empty for an item without), while `out`
    /// is the pending step.
    pub fn drafts_of(&self, out: &SchedulerOutput) -> Vec<&[u32]> {
        let of = |it: &ScheduledItem| match (it.drafts, self.drafted_tokens(it)) {
            (0, _) | (_, None) => &[][..],
            (_, Some(tokens)) => &tokens[1..],
        };
        out.items.iter().filter(|it| it.sample).map(of).collect()
    }

    /// Records a step whose items may carry drafts: `sampled` holds each sampling item's tokens in
    /// item order, `accepted[i] + 1` for sampling item `i`: its first `accepted[i]` drafts (which
    /// `sampled` must repeat) then the token drawn after them. The kept drafts' KV is recorded in
    /// their sequences, the blocks beyond it given back, and every item recorded as
    /// [`update`](Self::update) does. Fails, changing nothing, on a stale output, wrong counts or a
    /// token that is not the draft it claims to keep.
    pub fn update_drafted(
        &mut self,
        out: &SchedulerOutput,
        sampled: &[u32],
        accepted: &[usize],
        kv: &mut SequenceTable,
    ) -> Result<()> {
        self.check_pending(out)?;
        self.check_drafted(out, sampled, accepted)?;
        let (mut at, mut k) = (0, 0);
        for it in out.items.iter().filter(|it| it.sample) {
            let kept = accepted[k];
            if it.drafts > 0 && self.item_request(it).is_some() {
                let tokens = self.drafted_tokens(it).expect("checked");
                kv.append(it.seq, &tokens[1..1 + kept])?;
                kv.release_unused(it.seq)?;
                let draft = self.drafts.get_mut(&it.request).expect("drafted");
                draft.acceptance.record(it.drafts as usize, kept);
                draft.shadow = None;
            }
            at += kept + 1;
            k += 1;
        }
        debug_assert_eq!(at, sampled.len());
        self.record(out, sampled, accepted);
        Ok(())
    }

    /// Scores the shadow draft of a request that decoded `sampled` without drafts.
    pub(super) fn score_shadow(&mut self, request: u64, sampled: u32) {
        if let Some(draft) = self.drafts.get_mut(&request) {
            if let Some(shadow) = draft.shadow.take() {
                draft.acceptance.record(1, usize::from(shadow == sampled));
            }
        }
    }

    fn check_drafted(&self, out: &SchedulerOutput, sampled: &[u32], accepted: &[usize]) -> Result<()> {
        let bad = |msg: String| Err(Error::Value(format!("update_drafted(): {msg}")));
        if accepted.len() != out.num_sample() {
            return bad(format!("{} accepted counts for {} sampling items", accepted.len(), out.num_sample()));
        }
        let total: usize = accepted.iter().map(|a| a + 1).sum();
        if sampled.len() != total {
            return bad(format!("{} sampled tokens, but the accepted counts make {total}", sampled.len()));
        }
        let mut at = 0;
        for (it, &kept) in out.items.iter().filter(|it| it.sample).zip(accepted) {
            if kept > it.drafts as usize {
                return bad(format!("request {} keeps {kept} of its {} drafts", it.request, it.drafts));
            }
            let drafted = self.item_request(it).and_then(|_| self.drafted_tokens(it));
            if let Some(tokens) = drafted.filter(|_| kept > 0) {
                if sampled[at..at + kept] != tokens[1..1 + kept] {
                    return bad(format!("request {}'s kept tokens are not its drafts", it.request));
                }
            }
            at += kept + 1;
        }
        Ok(())
    }
}

/// Makes decode item `it` compute `drafted` drafts after its token.
fn extend(it: &mut ScheduledItem, drafted: usize) {
    it.num_tokens += drafted;
    it.drafts = drafted as u16;
}

//! `StepPlan`: a step's work as flat arrays, for runners other than the native one. Built after the
//! sequences' block tables have grown for the step (their blocks reserved) and before the tokens are
//! recorded, so a sequence's length is still its context before the step.

use crate::error::{Error, Result};
use crate::kv::{blocks_for, SequenceTable, BLOCK_TOKENS};

use super::{Logits, StepItem};

pub use crate::kv::TierCopies;

/// The attention metadata of one step, in vLLM's shape. Token `t` of the batch is `input_ids[t]` at
/// `positions[t]`, its K/V written to KV slot `slot_mapping[t]` (block * 16 + offset); sequence `s`
/// owns tokens `query_start_loc[s]..query_start_loc[s + 1]`, holds `seq_lens[s]` tokens of KV once
/// they are written, and reads them through row `s` of `block_tables` (`num_seqs x max_blocks`,
/// row-major, padded with 0). `logits_indices` lists the tokens whose logits the step returns, in
/// order. Positions at or past `decode_from[s]` hold tokens the request sampled (its prompt's
/// length): each was first computed alone in a decode step, and recomputing it after a preemption
/// takes the same attention path again when a runner routes rows by it. `copies` must run before
/// the forward pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub input_ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub slot_mapping: Vec<i64>,
    pub query_start_loc: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub block_tables: Vec<i32>,
    pub max_blocks: usize,
    pub logits_indices: Vec<i32>,
    pub decode_from: Vec<i32>,
    pub copies: TierCopies,
}

impl StepPlan {
    /// The plan of `items` over `table`, whose block tables already cover every item's tokens;
    /// `decode_from[i]` is item `i`'s request's prompt length. Each item's tokens follow its
    /// sequence's KV.
    pub fn build(items: &[StepItem], decode_from: &[usize], table: &SequenceTable) -> Result<StepPlan> {
        let starts = items.iter().map(|it| table.sequence_len(it.seq)).collect::<Result<Vec<usize>>>()?;
        StepPlan::build_at(items, &starts, decode_from, table)
    }

    /// [`build`](Self::build) with item `i`'s tokens at positions from `starts[i]`, which may lie past
    /// its sequence's KV: a step planned while the step before it, which computes the tokens in
    /// between, still runs.
    pub fn build_at(
        items: &[StepItem],
        starts: &[usize],
        decode_from: &[usize],
        table: &SequenceTable,
    ) -> Result<StepPlan> {
        if decode_from.len() != items.len() || starts.len() != items.len() {
            return Err(Error::Value(format!(
                "{} items but {} decode_from and {} start entries",
                items.len(),
                decode_from.len(),
                starts.len()
            )));
        }
        let tokens: usize = items.iter().map(|it| it.tokens.len()).sum();
        let mut plan = StepPlan {
            input_ids: Vec::with_capacity(tokens),
            positions: Vec::with_capacity(tokens),
            slot_mapping: Vec::with_capacity(tokens),
            query_start_loc: Vec::with_capacity(items.len() + 1),
            seq_lens: Vec::with_capacity(items.len()),
            decode_from: decode_from.iter().map(|&p| p.min(i32::MAX as usize) as i32).collect(),
            ..StepPlan::default()
        };
        plan.query_start_loc.push(0);
        for (item, &start) in items.iter().zip(starts) {
            let seq = table.get(item.seq)?;
            let end = start + item.tokens.len();
            if start < seq.len {
                return Err(Error::Value(format!("sequence {} already holds KV at position {start}", item.seq)));
            }
            if seq.block_table.len() < blocks_for(end) {
                return Err(Error::Value(format!("sequence {} has no blocks reserved for this step", item.seq)));
            }
            plan.max_blocks = plan.max_blocks.max(blocks_for(end));
            plan.push_item(item, start, &seq.block_table);
        }
        plan.block_tables = vec![0; items.len() * plan.max_blocks];
        for ((row, item), &start) in plan.block_tables.chunks_mut(plan.max_blocks.max(1)).zip(items).zip(starts) {
            let seq = table.get(item.seq)?;
            let used = blocks_for(start + item.tokens.len());
            for (dst, &block) in row.iter_mut().zip(&seq.block_table[..used]) {
                *dst = block as i32;
            }
        }
        Ok(plan)
    }

    /// Appends one item's tokens, starting at position `start`, stored through `block_table`.
    fn push_item(&mut self, item: &StepItem, start: usize, block_table: &[u32]) {
        let first = self.input_ids.len();
        for (i, &token) in item.tokens.iter().enumerate() {
            let pos = start + i;
            self.input_ids.push(token as i32);
            self.positions.push(pos as i32);
            let block = block_table[pos / BLOCK_TOKENS] as i64;
            self.slot_mapping.push(block * BLOCK_TOKENS as i64 + (pos % BLOCK_TOKENS) as i64);
        }
        let last = self.input_ids.len();
        match item.logits {
            Logits::None => {}
            Logits::Last => self.logits_indices.push(last as i32 - 1),
            Logits::All => self.logits_indices.extend(first as i32..last as i32),
        }
        self.query_start_loc.push(last as i32);
        self.seq_lens.push((start + item.tokens.len()) as i32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_locates_every_token_through_its_block_table() {
        let mut table = SequenceTable::new(8, 0, false);
        let a = table.add_sequence();
        let b = table.add_sequence();
        table.reserve(&[(a, 20)]).unwrap();
        table.append(a, &[7; 20]).unwrap();
        let decode = [5];
        let prompt = [1, 2, 3];
        let items = [StepItem::new(a, &decode, Logits::Last), StepItem::new(b, &prompt, Logits::All)];
        table.reserve(&[(a, 1), (b, 3)]).unwrap();
        let plan = StepPlan::build(&items, &[12, 3], &table).unwrap();
        let ta = &table.get(a).unwrap().block_table;
        let tb = &table.get(b).unwrap().block_table;
        assert_eq!(plan.input_ids, vec![5, 1, 2, 3]);
        assert_eq!(plan.positions, vec![20, 0, 1, 2]);
        let slot = |block: u32, off: i64| block as i64 * 16 + off;
        assert_eq!(plan.slot_mapping, vec![slot(ta[1], 4), slot(tb[0], 0), slot(tb[0], 1), slot(tb[0], 2)]);
        assert_eq!(plan.query_start_loc, vec![0, 1, 4]);
        assert_eq!(plan.seq_lens, vec![21, 3]);
        assert_eq!(plan.max_blocks, 2);
        assert_eq!(plan.block_tables, vec![ta[0] as i32, ta[1] as i32, tb[0] as i32, 0]);
        assert_eq!(plan.logits_indices, vec![0, 1, 2, 3]);
        assert_eq!(plan.decode_from, vec![12, 3]);
    }

    #[test]
    fn a_plan_needs_the_blocks_reserved() {
        let mut table = SequenceTable::new(4, 0, false);
        let a = table.add_sequence();
        let tokens = [1; 17];
        let items = [StepItem::new(a, &tokens, Logits::Last)];
        assert!(StepPlan::build(&items, &[17], &table).is_err());
        table.reserve(&[(a, 17)]).unwrap();
        assert!(StepPlan::build(&items, &[], &table).is_err(), "one decode_from per item");
        assert!(StepPlan::build(&items, &[17], &table).is_ok());
    }
}

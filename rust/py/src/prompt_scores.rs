//! Prompt logprobs out of a step's logits: the rows of the requests that asked for them, scored
//! against the next prompt token ([`score_token`]) across the thread pool, and the sampling rows set
//! apart for the samplers.

use oxibonsai_core::pool::Pool;
use oxibonsai_core::sample::score_token;
use oxibonsai_core::sched::LogitRows;

/// One prompt token's score: raw logprob, rank, and the top `(id, logprob)` pairs.
pub type TokenScore = (f32, u32, Vec<(u32, f32)>);

/// A request's scores for prompt positions `start..` (position `p` scores token `p + 1`).
pub type PromptScores = (u64, usize, Vec<TokenScore>);

/// Prompt rows a pool task scores at least (each row is a pass or three over the vocabulary).
const MIN_ROWS_PER_TASK: usize = 4;

/// Scores every prompt row of `rows` in `logits` (`rows.total` rows of `vocab`), the rows split
/// across `pool` (each row is scored by one task, so the split never changes a score).
pub fn score(rows: &LogitRows, logits: &[f32], vocab: usize, pool: &Pool) -> Vec<PromptScores> {
    // Every scored position: (its request's index in `rows.prompt`, its row, the token it scores).
    let positions: Vec<(usize, usize, u32)> = rows
        .prompt
        .iter()
        .enumerate()
        .flat_map(|(k, p)| p.targets.iter().enumerate().map(move |(j, &t)| (k, p.first_row + j, t)))
        .collect();
    let mut scores: Vec<Option<TokenScore>> = (0..positions.len()).map(|_| None).collect();
    if !scores.is_empty() {
        pool.for_each_row_mut(&mut scores, 1, MIN_ROWS_PER_TASK, |i, slot| {
            let (k, row, target) = positions[i];
            let s = score_token(&logits[row * vocab..(row + 1) * vocab], target, rows.prompt[k].top, &mut Vec::new());
            slot[0] = Some((s.logprob, s.rank, s.top));
        });
    }
    let mut scores = scores.into_iter().map(|s| s.expect("every position is scored"));
    rows.prompt.iter().map(|p| (p.request, p.start, scores.by_ref().take(p.targets.len()).collect())).collect()
}

/// The sampling rows of `logits`, in order, moved to the front (the rest is dropped).
pub fn keep_sample_rows(rows: &LogitRows, logits: &mut Vec<f32>, vocab: usize) {
    for (i, &row) in rows.sample.iter().enumerate() {
        if row != i {
            logits.copy_within(row * vocab..(row + 1) * vocab, i * vocab);
        }
    }
    logits.truncate(rows.sample.len() * vocab);
}

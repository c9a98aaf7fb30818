//! Prompt logprobs out of a step's logits: the rows of the requests that asked for them, scored
//! against the next prompt token ([`score_token`]), and the sampling rows set apart for the samplers.

use oxibonsai_core::sample::score_token;
use oxibonsai_core::sched::LogitRows;

/// One prompt token's score: raw logprob, rank, and the top `(id, logprob)` pairs.
pub type TokenScore = (f32, u32, Vec<(u32, f32)>);

/// A request's scores for prompt positions `start..` (position `p` scores token `p + 1`).
pub type PromptScores = (u64, usize, Vec<TokenScore>);

/// Scores every prompt row of `rows` in `logits` (`rows.total` rows of `vocab`).
pub fn score(rows: &LogitRows, logits: &[f32], vocab: usize) -> Vec<PromptScores> {
    let mut ids = Vec::new();
    rows.prompt
        .iter()
        .map(|p| {
            let scores = p.targets.iter().enumerate().map(|(j, &target)| {
                let row = &logits[(p.first_row + j) * vocab..(p.first_row + j + 1) * vocab];
                let s = score_token(row, target, p.top, &mut ids);
                (s.logprob, s.rank, s.top)
            });
            (p.request, p.start, scores.collect())
        })
        .collect()
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

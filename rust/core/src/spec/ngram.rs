//! Prompt-lookup drafting: find the longest suffix of the request's tokens (between `min_n` and
//! `max_n` tokens) that also occurs earlier, latest occurrence first, and propose the tokens that
//! followed it there. Repeats of the prompt (quoted text, code being edited, a summary's names) and
//! of the output so far come back as drafts; free text rarely matches and costs nothing.

use crate::error::{Error, Result};

/// Most tokens a step drafts for one request.
pub const MAX_DRAFT_TOKENS: usize = 64;

/// What an n-gram proposer drafts: up to `num_tokens` tokens after a match of `min_n..=max_n` tokens;
/// `adaptive`: only as many as pay for their rows at the request's acceptance so far
/// ([`super::acceptance`]), else all `num_tokens` whenever a match is found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramConfig {
    pub num_tokens: usize,
    pub min_n: usize,
    pub max_n: usize,
    pub adaptive: bool,
}

impl NgramConfig {
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_DRAFT_TOKENS).contains(&self.num_tokens) {
            return Err(Error::Value(format!(
                "num_speculative_tokens must be in 1..={MAX_DRAFT_TOKENS}, got {}",
                self.num_tokens
            )));
        }
        if self.min_n == 0 || self.min_n > self.max_n {
            return Err(Error::Value(format!(
                "the n-gram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got {} and {}",
                self.min_n, self.max_n
            )));
        }
        Ok(())
    }
}

/// Appends to `out` `limit` tokens drafted to follow `tokens`, or none when no suffix of at least
/// `min_n` tokens occurred before. One backward pass: at each earlier end position the
/// match with the suffix is measured (mostly one comparison), the longest kept, the latest among
/// equals; a match of `max_n` tokens ends the search.
pub fn propose(tokens: &[u32], config: &NgramConfig, limit: usize, out: &mut Vec<u32>) {
    let len = tokens.len();
    if limit == 0 || len < config.min_n + 1 {
        return;
    }
    let (last, mut best_len, mut best_end) = (tokens[len - 1], 0, 0);
    // `end`: one past an earlier occurrence's last token; the continuation starts there.
    for end in (1..len).rev() {
        if tokens[end - 1] != last {
            continue;
        }
        let matched = suffix_match(tokens, end, config.max_n);
        if matched > best_len {
            (best_len, best_end) = (matched, end);
            if matched == config.max_n {
                break;
            }
        }
    }
    if best_len >= config.min_n {
        continue_from(tokens, best_end, limit, out);
    }
}

/// Appends `limit` tokens continuing `tokens` as they went on after position `from`; past their end
/// the drafts continue themselves (an overlapping copy, as in LZ77), so a repeat that ends close
/// to the end of `tokens` still drafts `limit` tokens: the period repeats.
fn continue_from(tokens: &[u32], from: usize, limit: usize, out: &mut Vec<u32>) {
    let (len, base) = (tokens.len(), out.len());
    for i in 0..limit {
        let at = from + i;
        let token = if at < len { tokens[at] } else { out[base + at - len] };
        out.push(token);
    }
}

/// How many tokens (at most `max_n`) before `end` equal the last tokens of `tokens`.
fn suffix_match(tokens: &[u32], end: usize, max_n: usize) -> usize {
    let len = tokens.len();
    let most = max_n.min(end);
    (0..most).take_while(|&i| tokens[end - 1 - i] == tokens[len - 1 - i]).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition: for n from `max_n` down to `min_n`, the latest earlier occurrence of the last
    /// n tokens, and what followed it (with the drafts themselves once `tokens` end).
    fn reference(tokens: &[u32], c: &NgramConfig, limit: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (c.min_n..=c.max_n).rev() {
            if len < n + 1 {
                continue;
            }
            let suffix = &tokens[len - n..];
            if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
                let mut all = tokens.to_vec();
                for i in 0..limit {
                    all.push(all[start + n + i]);
                }
                return all[len..].to_vec();
            }
        }
        Vec::new()
    }

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn drafts_match_the_definition_on_random_token_lists() {
        let mut state = 0x9E37_79B9_7F4A_7C15 ^ std::process::id() as u64;
        for _ in 0..20_000 {
            let vocab = 2 + xorshift(&mut state) % 6;
            let len = xorshift(&mut state) % 40;
            let tokens: Vec<u32> = (0..len).map(|_| (xorshift(&mut state) % vocab) as u32).collect();
            let max_n = 1 + (xorshift(&mut state) % 5) as usize;
            let min_n = 1 + (xorshift(&mut state) % max_n as u64) as usize;
            let config = NgramConfig { num_tokens: 8, min_n, max_n, adaptive: false };
            let limit = (xorshift(&mut state) % 9) as usize;
            let mut got = Vec::new();
            propose(&tokens, &config, limit, &mut got);
            assert_eq!(got, reference(&tokens, &config, limit), "{tokens:?} {config:?} limit {limit}");
        }
    }

    #[test]
    fn a_repeated_phrase_is_drafted_from_its_latest_occurrence() {
        let c = NgramConfig { num_tokens: 4, min_n: 2, max_n: 3, adaptive: false };
        let mut out = Vec::new();
        propose(&[1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], &c, 3, &mut out);
        assert_eq!(out, [7, 8, 5]);
        out.clear();
        propose(&[4, 1, 2, 1, 2], &c, 5, &mut out);
        assert_eq!(out, [1, 2, 1, 2, 1], "a period continues past the end");
        out.clear();
        propose(&[4, 5, 6, 7], &c, 3, &mut out);
        assert!(out.is_empty(), "no repeat, no draft");
    }

    #[test]
    fn configs_are_validated() {
        assert!(NgramConfig { num_tokens: 0, min_n: 1, max_n: 2, adaptive: true }.validate().is_err());
        assert!(NgramConfig { num_tokens: 65, min_n: 1, max_n: 2, adaptive: true }.validate().is_err());
        assert!(NgramConfig { num_tokens: 3, min_n: 3, max_n: 2, adaptive: true }.validate().is_err());
        assert!(NgramConfig { num_tokens: 3, min_n: 0, max_n: 2, adaptive: true }.validate().is_err());
        assert!(NgramConfig { num_tokens: 3, min_n: 2, max_n: 2, adaptive: true }.validate().is_ok());
    }
}

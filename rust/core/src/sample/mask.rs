//! `TokenMask`: the ids a request may sample at this step, as the bitmask grammar engines fill
//! (llguidance, xgrammar): bit `i % 32` of word `i / 32` is set where id `i` is allowed. Structured
//! output (JSON, a regex, a grammar) hands the sampler one per step. It is applied with the bans,
//! after the penalties: an id it does not allow gets a `-inf` logit.

use crate::{Error, Result};

/// A borrowed allow-bitmask over a vocabulary (see the module doc).
#[derive(Debug, Clone, Copy)]
pub struct TokenMask<'a> {
    words: &'a [u32],
}

impl<'a> TokenMask<'a> {
    pub fn new(words: &'a [u32]) -> TokenMask<'a> {
        TokenMask { words }
    }

    /// Whether id `id` may be sampled (ids past the mask's words are not).
    pub fn allows(&self, id: u32) -> bool {
        let word = self.words.get((id / 32) as usize).copied().unwrap_or(0);
        word >> (id % 32) & 1 == 1
    }

    /// Fails unless the mask has exactly one bit per id of a vocabulary of `vocab` (rounded up to
    /// whole words).
    pub(crate) fn check(&self, vocab: usize) -> Result<()> {
        let want = vocab.div_ceil(32);
        if self.words.len() != want {
            return Err(Error::Shape(format!(
                "the token mask has {} words; a vocabulary of {vocab} needs {want} (one bit per id)",
                self.words.len()
            )));
        }
        Ok(())
    }

    /// Sets the logit of every id the mask does not allow to `-inf`. `logits` must be the
    /// vocabulary [`check`](Self::check) accepted.
    pub(crate) fn apply(&self, logits: &mut [f32]) {
        for (chunk, &word) in logits.chunks_mut(32).zip(self.words) {
            if word == u32::MAX {
                continue;
            }
            for (bit, v) in chunk.iter_mut().enumerate() {
                if word >> bit & 1 == 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// The first allowed id holding the largest finite-or-`-inf` logit above `-inf` (ties to the
    /// lowest id), or `None` when every allowed logit is `-inf`. `logits` must be the vocabulary
    /// [`check`](Self::check) accepted. Whole allowed words take a vectorizable max first.
    pub(crate) fn argmax(&self, logits: &[f32]) -> Option<u32> {
        let mut best = (f32::NEG_INFINITY, None);
        for (w, (chunk, &word)) in logits.chunks(32).zip(self.words).enumerate() {
            if word == u32::MAX {
                let max = chunk.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                if max > best.0 {
                    let at = chunk.iter().position(|&v| v == max).expect("max is in the chunk");
                    best = (max, Some(32 * w + at));
                }
                continue;
            }
            let mut bits = word;
            while bits != 0 {
                let bit = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if let Some(&v) = chunk.get(bit) {
                    if v > best.0 {
                        best = (v, Some(32 * w + bit));
                    }
                }
            }
        }
        best.1.map(|id| id as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_keeps_exactly_the_allowed_ids() {
        let vocab = 75;
        let words = [0x8000_0001u32, u32::MAX, 0b101];
        let mask = TokenMask::new(&words);
        mask.check(vocab).unwrap();
        let mut logits: Vec<f32> = (0..vocab).map(|i| i as f32).collect();
        mask.apply(&mut logits);
        for (i, &v) in logits.iter().enumerate() {
            let allowed = i == 0 || i == 31 || (32..64).contains(&i) || i == 64 || i == 66;
            assert_eq!(mask.allows(i as u32), allowed, "id {i}");
            assert_eq!(v, if allowed { i as f32 } else { f32::NEG_INFINITY }, "id {i}");
        }
        assert!(!mask.allows(96), "ids past the words are not allowed");
    }

    #[test]
    fn a_mask_of_the_wrong_length_is_refused() {
        let words = [u32::MAX; 2];
        assert!(TokenMask::new(&words).check(64).is_ok());
        assert!(TokenMask::new(&words).check(63).is_ok());
        let err = TokenMask::new(&words).check(65).unwrap_err();
        assert!(matches!(err, Error::Shape(m) if m.contains("needs 3")));
        assert!(TokenMask::new(&words).check(32).is_err());
    }
}

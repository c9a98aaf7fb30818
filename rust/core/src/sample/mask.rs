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

//! The structured-output token mask against its reference: masking ids is banning them. On fresh
//! random vocabularies, configs and masks, `sample_masked` / `probabilities_masked` equal `sample` /
//! `probabilities` with every id the mask does not allow added to the bans, draw for draw.

mod common;

use common::Rng as TestRng;
use oxibonsai_core::sample::{History, Sampler, SamplingConfig, TokenMask};
use oxibonsai_core::Error;

fn random_mask(rng: &mut TestRng, vocab: usize) -> Vec<u32> {
    let density = [0.02, 0.3, 0.9, 1.0][(rng.next_u64() % 4) as usize];
    let mut words = vec![0u32; vocab.div_ceil(32)];
    for id in 0..vocab {
        if rng.uniform() < density {
            words[id / 32] |= 1 << (id % 32);
        }
    }
    words
}

fn random_config(rng: &mut TestRng) -> SamplingConfig {
    let pick = |rng: &mut TestRng, xs: &[f32]| xs[(rng.next_u64() % xs.len() as u64) as usize];
    SamplingConfig {
        temperature: pick(rng, &[0.0, 0.5, 1.0]),
        top_k: [0, 1, 5][(rng.next_u64() % 3) as usize],
        top_p: pick(rng, &[1.0, 0.8]),
        min_p: pick(rng, &[0.0, 0.1]),
        repetition_penalty: pick(rng, &[1.0, 1.3]),
        ..Default::default()
    }
}

#[test]
fn masking_equals_banning_every_id_the_mask_does_not_allow() {
    let mut rng = TestRng::fresh("mask = bans");
    let mut sampled = 0;
    for case in 0..400 {
        let vocab = 1 + (rng.next_u64() % 300) as usize;
        let logits: Vec<f32> = (0..vocab).map(|_| 2.0 * rng.normal()).collect();
        let words = random_mask(&mut rng, vocab);
        let mask = TokenMask::new(&words);
        let banned: Vec<u32> = (0..rng.next_u64() % 3).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
        let mut as_bans = banned.clone();
        as_bans.extend((0..vocab as u32).filter(|&id| !mask.allows(id)));
        let (prompt, output) = ([0u32], [(vocab as u32 - 1) / 2]);
        let h = History::new(&prompt, &output);
        let config = random_config(&mut rng);
        let seed = rng.next_u64();
        let (mut masked, mut reference) = (Sampler::new(config, seed).unwrap(), Sampler::new(config, seed).unwrap());
        let got = masked.probabilities_masked(&logits, &h, &banned, Some(mask));
        let want = reference.probabilities(&logits, &h, &as_bans);
        match (got, want) {
            (Ok(g), Ok(w)) => assert_eq!(g, w, "case {case}"),
            (Err(g), Err(w)) => {
                assert!(matches!(g, Error::Value(_)) && g.to_string() == w.to_string(), "case {case}: {g}");
                continue;
            }
            (g, w) => panic!("case {case}: {g:?} vs {w:?}"),
        }
        for _ in 0..3 {
            let a = masked.sample_masked(&logits, &h, &banned, Some(mask), Some(2)).unwrap();
            let b = reference.sample(&logits, &h, &as_bans, Some(2)).unwrap();
            assert_eq!(a, b, "case {case}");
            assert!(mask.allows(a.token) && !banned.contains(&a.token), "case {case}: {a:?}");
            sampled += 1;
        }
    }
    assert!(sampled > 300, "only {sampled} draws had a token left to sample");
}

#[test]
fn a_mask_allowing_nothing_or_of_the_wrong_length_is_an_error() {
    let logits = [0.0f32; 40];
    let h = History::default();
    let mut sampler = Sampler::new(SamplingConfig::greedy(), 0).unwrap();
    let none = [0u32, 0];
    let err = sampler.sample_masked(&logits, &h, &[], Some(TokenMask::new(&none)), None).unwrap_err();
    assert!(err.to_string().contains("banned or masked"), "{err}");
    let short = [u32::MAX];
    let err = sampler.sample_masked(&logits, &h, &[], Some(TokenMask::new(&short)), None).unwrap_err();
    assert!(matches!(err, Error::Shape(_)), "{err}");
    let only_39 = [0u32, 1 << 7];
    let got = sampler.sample_masked(&logits, &h, &[], Some(TokenMask::new(&only_39)), None).unwrap();
    assert_eq!(got.token, 39);
}

/// Greedy sampling under a mask with nothing else to apply reads the logits in place; it gives the
/// tokens, logprobs and errors of the general path, which a penalty without effect (no history)
/// forces. Random logits with exact ties and `-inf`, masks from empty to full.
#[test]
fn masked_greedy_in_place_equals_the_general_path() {
    let mut rng = TestRng::fresh("masked greedy");
    let general = SamplingConfig { repetition_penalty: 1.5, ..SamplingConfig::greedy() };
    let (mut fast, mut full) = (Sampler::new(SamplingConfig::greedy(), 0).unwrap(), Sampler::new(general, 0).unwrap());
    let h = History::default();
    let mut errors = 0;
    for _ in 0..400 {
        let vocab = 1 + (rng.next_u64() % 200) as usize;
        let logits: Vec<f32> = (0..vocab)
            .map(|_| match rng.next_u64() % 6 {
                0 => f32::NEG_INFINITY,
                1 => 2.0, // ties
                _ => rng.normal(),
            })
            .collect();
        let words = random_mask(&mut rng, vocab);
        for n in [None, Some(2)] {
            let mask = Some(TokenMask::new(&words));
            match (fast.sample_masked(&logits, &h, &[], mask, n), full.sample_masked(&logits, &h, &[], mask, n)) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{logits:?} {words:?}"),
                (Err(a), Err(b)) => {
                    assert_eq!(a.to_string(), b.to_string());
                    errors += 1;
                }
                (a, b) => panic!("{a:?} vs {b:?} for {logits:?} {words:?}"),
            }
        }
    }
    assert!(errors > 0, "some masks allow only -inf logits");
    let nan = [0.0, f32::NAN];
    let all = [u32::MAX];
    let (a, b) = (
        fast.sample_masked(&nan, &h, &[], Some(TokenMask::new(&all)), None),
        full.sample_masked(&nan, &h, &[], Some(TokenMask::new(&all)), None),
    );
    assert_eq!(a.unwrap_err().to_string(), b.unwrap_err().to_string());
}

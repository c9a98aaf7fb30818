//! Sampling: one sequence's logits in, one token out, seeded per request.
//!
//! A [`Sampler`] owns one request's [`SamplingConfig`] and its own [`Rng`], so the token it draws
//! depends only on the request's seed, its logits and its token [`History`], never on the rest of the
//! batch. The pipeline (vLLM's semantics) is: the logit bias, repetition penalty over prompt and output tokens,
//! frequency/presence penalties over output tokens, banned ids (and those a structured-output
//! [`TokenMask`] does not allow) to `-inf`, then either greedy argmax or
//! temperature -> top-k -> top-p -> min-p -> one inverse-CDF draw. Logprobs are the `log_softmax` of
//! the *raw* logits. `Sampler::sample` allocates nothing O(vocab) per step (its buffers are a
//! per-thread scratch, `scratch.rs`), never sorts the vocabulary (top-k and top-p select, after a
//! cheap threshold prunes what cannot survive), and runs its softmaxes on a vectorized `exp`.

mod bias;
mod config;
mod filters;
mod logprobs;
mod mask;
pub(crate) mod math;
mod penalties;
mod rank;
mod rng;
mod sampler;
mod scratch;

pub use bias::{LogitBias, MAX_BIAS};
pub use config::SamplingConfig;
pub use logprobs::{score_token, TokenScore};
pub use mask::TokenMask;
pub use penalties::History;
pub use rng::Rng;
pub use sampler::{Sampled, Sampler};

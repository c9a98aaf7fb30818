//! The per-thread scratch buffers of the sampler: a copy of the logits, a candidate list and the
//! zeroed `marks` array the penalties count in. One set per thread, not per request, so thousands of
//! live requests do not each hold O(vocab) memory, and a decode step allocates nothing O(vocab).

use std::cell::RefCell;

#[derive(Default)]
pub(crate) struct Scratch {
    /// The logits being processed, then (for candidates) their unnormalized weights.
    pub logits: Vec<f32>,
    /// Token ids still in the running.
    pub cand: Vec<u32>,
    /// The candidates' weights in candidate order, once filters left a proper subset (the draw's walk).
    pub kept: Vec<f32>,
    /// All zero between uses; see `penalties::apply`.
    pub marks: Vec<u32>,
}

impl Scratch {
    /// Copies `logits` in and makes `marks` long enough.
    pub fn load(&mut self, logits: &[f32]) {
        self.logits.clear();
        self.logits.extend_from_slice(logits);
        if self.marks.len() < logits.len() {
            self.marks.resize(logits.len(), 0);
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `work` with this thread's scratch (a fresh one if it is somehow already in use).
pub(crate) fn with_scratch<R>(work: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => work(&mut scratch),
        Err(_) => work(&mut Scratch::default()),
    })
}

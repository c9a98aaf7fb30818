//! `TierCopies`: the block copies between the device and host tiers that one step records. The prefix
//! cache records them as it demotes and promotes blocks; a runner executes them in the order of the
//! fields: demotions, then promotions, then the forward pass, then prefetches (or the prefetches at
//! any point after the demotions: nothing the step's forward pass reads or writes is a prefetch's
//! source or destination). The step's forward pass needs the demotions and promotions done; only the
//! next step needs the prefetches. The cache keeps every block a pending copy reads or writes out of
//! reach (not reusable, not evictable) until the step's copies are reported complete, except a
//! demoted device block, which only the step's own later work (promotions, the forward pass,
//! prefetches) may reuse, after its copy in stream order. A host block demoted to in a step may be
//! promoted or prefetched from in the same step: its demotion must have landed first.

/// Pairs of `[source block, destination block]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierCopies {
    /// Device block to host block.
    pub demote: Vec<[u32; 2]>,
    /// Host block to device block, for a sequence of this step.
    pub promote: Vec<[u32; 2]>,
    /// Host block to device block, for a request still waiting (its blocks idle, cached on the
    /// device, by the next step).
    pub prefetch: Vec<[u32; 2]>,
}

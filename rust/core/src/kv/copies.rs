//! `TierCopies`: the block copies between the device and host tiers that one step needs before its
//! forward pass. The prefix cache records them as it demotes and promotes blocks; a runner executes
//! them, demotions first, then promotions, then the forward pass, in that order on one stream. The
//! cache keeps every block a pending copy reads or writes out of reach (not reusable, not evictable)
//! until the step's copies are reported complete, except a demoted device block, which only the
//! step's own later work (promotions, the forward pass) may reuse, after its copy in stream order.

/// Pairs of `[source block, destination block]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierCopies {
    /// Device block to host block.
    pub demote: Vec<[u32; 2]>,
    /// Host block to device block.
    pub promote: Vec<[u32; 2]>,
}

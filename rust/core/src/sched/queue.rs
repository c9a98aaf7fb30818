//! `WaitingQueue`: requests waiting to run, best first: ascending `(key, arrival)` where
//! `key = priority * aging_steps + enqueue step`. Because every waiting request ages at the same
//! rate, aging never reorders the queue after insertion; it only places newcomers behind requests
//! that have waited long enough to make up their priority difference. Insert, remove and pop are
//! O(log n).

use std::collections::BTreeSet;

#[derive(Default, Debug)]
pub struct WaitingQueue {
    order: BTreeSet<(i128, u64, u64)>,
}

impl WaitingQueue {
    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub fn push(&mut self, key: i128, arrival: u64, id: u64) {
        self.order.insert((key, arrival, id));
    }

    pub fn remove(&mut self, key: i128, arrival: u64, id: u64) -> bool {
        self.order.remove(&(key, arrival, id))
    }

    /// Request ids, best first.
    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.order.iter().map(|&(_, _, id)| id)
    }

    pub fn first(&self) -> Option<u64> {
        self.ids().next()
    }
}

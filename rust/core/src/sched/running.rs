//! `RunningSet`: the running requests in the order steps visit them, ascending
//! `(priority, admitted)` (each with its slot), kept in a sorted `Vec`: at most `max_num_seqs` small
//! entries, so an insert or remove is a binary search and a short shift, and a step walks it as a slice.

/// `(priority, admitted, slot)`; `admitted` is unique, so the slot never decides the order.
pub type RunningKey = (i32, u64, u32);

#[derive(Default, Debug)]
pub struct RunningSet {
    keys: Vec<RunningKey>,
}

impl RunningSet {
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn insert(&mut self, key: RunningKey) {
        if let Err(at) = self.keys.binary_search(&key) {
            self.keys.insert(at, key);
        }
    }

    pub fn remove(&mut self, key: RunningKey) -> bool {
        match self.keys.binary_search(&key) {
            Ok(at) => {
                self.keys.remove(at);
                true
            }
            Err(_) => false,
        }
    }

    pub fn contains(&self, key: RunningKey) -> bool {
        self.keys.binary_search(&key).is_ok()
    }

    /// Best first.
    pub fn iter(&self) -> std::slice::Iter<'_, RunningKey> {
        self.keys.iter()
    }
}

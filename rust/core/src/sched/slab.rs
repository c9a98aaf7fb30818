//! `RequestSlab`: the scheduler's requests in a `Vec`, each at a slot that stays fixed while the
//! request lives (a finished request's slot is reused). Steps address requests by slot; the id map
//! is touched only by `add`, `finish` and lookups by id.

use rustc_hash::FxHashMap;

use super::request::Request;

#[derive(Default)]
pub struct RequestSlab {
    slots: Vec<Option<Request>>,
    free: Vec<u32>,
    index: FxHashMap<u64, u32>,
}

impl RequestSlab {
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.index.contains_key(&id)
    }

    /// Stores a request (its id must be new) and returns its slot.
    pub fn insert(&mut self, request: Request) -> u32 {
        let id = request.id;
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(request);
                slot
            }
            None => {
                self.slots.push(Some(request));
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(id, slot);
        slot
    }

    /// Takes a request out, freeing its slot.
    pub fn remove(&mut self, id: u64) -> Option<Request> {
        let slot = self.index.remove(&id)?;
        self.free.push(slot);
        self.slots[slot as usize].take()
    }

    pub fn slot_of(&self, id: u64) -> Option<u32> {
        self.index.get(&id).copied()
    }

    pub fn get(&self, id: u64) -> Option<&Request> {
        self.slot_of(id).map(|slot| self.at(slot))
    }

    /// The request at a live slot.
    pub fn at(&self, slot: u32) -> &Request {
        self.slots[slot as usize].as_ref().expect("a live slot")
    }

    pub fn at_mut(&mut self, slot: u32) -> &mut Request {
        self.slots[slot as usize].as_mut().expect("a live slot")
    }

    /// Request `id` at `slot` if it still runs on sequence `seq` (sequence ids are never reused, so
    /// a request finished or preempted since, or a slot's new owner, does not match).
    pub fn running_at(&self, slot: u32, id: u64, seq: u64) -> Option<&Request> {
        self.slots.get(slot as usize)?.as_ref().filter(|r| r.id == id && r.seq == Some(seq))
    }

    pub fn running_at_mut(&mut self, slot: u32, id: u64, seq: u64) -> Option<&mut Request> {
        self.slots.get_mut(slot as usize)?.as_mut().filter(|r| r.id == id && r.seq == Some(seq))
    }

    pub fn values(&self) -> impl Iterator<Item = &Request> {
        self.slots.iter().flatten()
    }
}

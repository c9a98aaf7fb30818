//! `SequenceSlab`: the live sequences of a [`SequenceTable`](super::SequenceTable), found by id
//! without hashing. An id is `generation << 32 | (slot + 1)`: the slot a sequence lives in, and how
//! many sequences lived there before it, so an id is never reused (the first sequences get ids
//! 1, 2, 3, ... as before slots are recycled) and a stale id finds nothing.

use super::sequence::Sequence;

#[derive(Default)]
pub struct SequenceSlab {
    /// Per slot: its current generation and its sequence, if live.
    slots: Vec<(u32, Option<Sequence>)>,
    free: Vec<u32>,
    len: usize,
}

const SLOT_BITS: u32 = 32;

fn id_of(slot: u32, generation: u32) -> u64 {
    (u64::from(generation) << SLOT_BITS) | (u64::from(slot) + 1)
}

impl SequenceSlab {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Stores a sequence and returns its new id.
    pub fn insert(&mut self, seq: Sequence) -> u64 {
        self.len += 1;
        if let Some(slot) = self.free.pop() {
            let entry = &mut self.slots[slot as usize];
            entry.0 += 1;
            entry.1 = Some(seq);
            return id_of(slot, entry.0);
        }
        self.slots.push((0, Some(seq)));
        id_of((self.slots.len() - 1) as u32, 0)
    }

    /// The slot of a live id.
    fn slot(&self, id: u64) -> Option<usize> {
        let slot = (id & u64::from(u32::MAX)).checked_sub(1)? as usize;
        let (generation, seq) = self.slots.get(slot)?;
        (u64::from(*generation) == id >> SLOT_BITS && seq.is_some()).then_some(slot)
    }

    pub fn get(&self, id: u64) -> Option<&Sequence> {
        self.slot(id).and_then(|slot| self.slots[slot].1.as_ref())
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut Sequence> {
        self.slot(id).and_then(|slot| self.slots[slot].1.as_mut())
    }

    pub fn remove(&mut self, id: u64) -> Option<Sequence> {
        let slot = self.slot(id)?;
        self.len -= 1;
        self.free.push(slot as u32);
        self.slots[slot].1.take()
    }

    /// Live sequences with their ids.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Sequence)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, (generation, seq))| seq.as_ref().map(|s| (id_of(slot as u32, *generation), s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_never_reused_and_stale_ids_find_nothing() {
        let mut slab = SequenceSlab::default();
        let a = slab.insert(Sequence::default());
        let b = slab.insert(Sequence::default());
        assert_eq!((a, b), (1, 2));
        assert!(slab.remove(a).is_some());
        let c = slab.insert(Sequence::default());
        assert!(c != a && c != b);
        assert!(slab.get(a).is_none() && slab.remove(a).is_none());
        assert!(slab.get(c).is_some() && slab.get(b).is_some());
        assert!(slab.get(0).is_none() && slab.get(999).is_none() && slab.get(u64::MAX).is_none());
        assert_eq!(slab.len(), 2);
        let mut ids: Vec<u64> = slab.iter().map(|(id, _)| id).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![b, c]);
    }
}

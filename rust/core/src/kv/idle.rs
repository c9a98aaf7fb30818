//! `IdleOrder`: the idle leaves of the block trie in eviction order, least recently used first, by
//! `(tick, block)`. Leaves nearly always arrive at an end of the order: a block released now has the
//! newest tick (it goes last), and a parent whose last child was just evicted is usually older than
//! every other leaf (it goes first). Both are O(1) on a doubly linked list threaded through one slot
//! per physical block. A leaf whose tick falls in the middle (a parent used after other chains) is kept
//! aside in a small ordered set, and [`IdleOrder::pop_first`] takes the smaller of the two heads, so the
//! order is exact.

use std::collections::BTreeSet;

/// No block: the end of the list.
const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Out,
    List,
    Aside,
}

#[derive(Clone, Copy)]
struct Slot {
    prev: u32,
    next: u32,
    tick: u64,
    place: Place,
}

/// Idle leaves by `(tick, block)`: a sorted linked list plus the out-of-order ones.
pub struct IdleOrder {
    slots: Vec<Slot>,
    head: u32,
    tail: u32,
    listed: usize,
    aside: BTreeSet<(u64, u32)>,
}

impl IdleOrder {
    pub fn new(num_blocks: usize) -> IdleOrder {
        let slot = Slot { prev: NIL, next: NIL, tick: 0, place: Place::Out };
        IdleOrder { slots: vec![slot; num_blocks], head: NIL, tail: NIL, listed: 0, aside: BTreeSet::new() }
    }

    pub fn len(&self) -> usize {
        self.listed + self.aside.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, block: u32) -> bool {
        self.slots[block as usize].place != Place::Out
    }

    /// Adds `block`, last used at `tick`; it must not be in the order.
    #[inline]
    pub fn insert(&mut self, block: u32, tick: u64) {
        let slot = &mut self.slots[block as usize];
        debug_assert_eq!(slot.place, Place::Out);
        slot.tick = tick;
        let entry = (tick, block);
        if self.tail == NIL || self.entry(self.tail) < entry {
            self.push_back(block);
        } else if entry < self.entry(self.head) {
            self.push_front(block);
        } else {
            self.slots[block as usize].place = Place::Aside;
            self.aside.insert(entry);
        }
    }

    /// Takes `block` out of the order (nothing if it is not in it).
    #[inline]
    pub fn remove(&mut self, block: u32) {
        let slot = self.slots[block as usize];
        match slot.place {
            Place::Out => return,
            Place::List => self.unlink(slot),
            Place::Aside => {
                self.aside.remove(&(slot.tick, block));
            }
        }
        self.slots[block as usize].place = Place::Out;
    }

    /// Removes and returns the least recently used block.
    pub fn pop_first(&mut self) -> Option<u32> {
        if self.aside.is_empty() && self.head != NIL {
            // The common case: nothing out of order, the list's head goes.
            let head = self.head;
            self.unlink(self.slots[head as usize]);
            self.slots[head as usize].place = Place::Out;
            return Some(head);
        }
        let listed = (self.head != NIL).then(|| self.entry(self.head));
        let first = match (listed, self.aside.first()) {
            (Some(l), Some(&a)) => l.min(a),
            (Some(l), None) => l,
            (None, Some(&a)) => a,
            (None, None) => return None,
        };
        self.remove(first.1);
        Some(first.1)
    }

    /// Checks the links, the list's order and the counts against `expected` (the blocks that should be
    /// in the order); for tests.
    pub fn check(&self, expected: usize) -> Result<(), String> {
        let (mut prev, mut at, mut count) = (NIL, self.head, 0);
        while at != NIL {
            let slot = &self.slots[at as usize];
            if slot.place != Place::List || slot.prev != prev {
                return Err(format!("block {at} is badly linked in the eviction order"));
            }
            if prev != NIL && self.entry(prev) >= self.entry(at) {
                return Err(format!("block {at} is out of order in the eviction list"));
            }
            (prev, at, count) = (at, slot.next, count + 1);
        }
        if prev != self.tail || count != self.listed {
            return Err("the eviction list's tail or length is wrong".into());
        }
        if self
            .aside
            .iter()
            .any(|&(tick, b)| self.slots[b as usize].place != Place::Aside || self.slots[b as usize].tick != tick)
        {
            return Err("an out-of-order idle leaf is misfiled".into());
        }
        let placed = self.slots.iter().filter(|s| s.place != Place::Out).count();
        if placed != self.len() || placed != expected {
            return Err(format!("{placed} blocks are in the eviction order, expected {expected}"));
        }
        Ok(())
    }

    fn entry(&self, block: u32) -> (u64, u32) {
        (self.slots[block as usize].tick, block)
    }

    fn push_back(&mut self, block: u32) {
        let tail = self.tail;
        self.slots[block as usize] = Slot { prev: tail, next: NIL, place: Place::List, ..self.slots[block as usize] };
        match tail {
            NIL => self.head = block,
            t => self.slots[t as usize].next = block,
        }
        self.tail = block;
        self.listed += 1;
    }

    fn push_front(&mut self, block: u32) {
        let head = self.head;
        self.slots[block as usize] = Slot { prev: NIL, next: head, place: Place::List, ..self.slots[block as usize] };
        match head {
            NIL => self.tail = block,
            h => self.slots[h as usize].prev = block,
        }
        self.head = block;
        self.listed += 1;
    }

    fn unlink(&mut self, slot: Slot) {
        match slot.prev {
            NIL => self.head = slot.next,
            p => self.slots[p as usize].next = slot.next,
        }
        match slot.next {
            NIL => self.tail = slot.prev,
            n => self.slots[n as usize].prev = slot.prev,
        }
        self.listed -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random inserts, removes and pops against a plain sorted set.
    #[test]
    fn matches_a_sorted_set() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let mut order = IdleOrder::new(64);
        let mut model = BTreeSet::new();
        let mut tick = 0;
        for _ in 0..20_000 {
            let block = rand(64) as u32;
            match rand(4) {
                0 | 1 if !order.contains(block) => {
                    // New ticks mostly, sometimes an old one (a parent becoming a leaf).
                    tick += 1;
                    let t = if rand(3) == 0 { rand(tick + 1) } else { tick };
                    order.insert(block, t);
                    model.insert((t, block));
                }
                2 if order.contains(block) => {
                    let entry = *model.iter().find(|e| e.1 == block).unwrap();
                    order.remove(block);
                    model.remove(&entry);
                }
                _ => assert_eq!(order.pop_first(), model.pop_first().map(|e| e.1)),
            }
            order.check(model.len()).unwrap();
        }
    }
}

//! `BlockPool`: the allocator of physical KV blocks. A free list and one reference count per block;
//! a block returns to the free list when its last reference is released. (The prefix cache builds
//! on these counts to share blocks between sequences.)

use crate::error::{Error, Result};

/// The physical blocks of a KV cache and who holds them.
pub struct BlockPool {
    free: Vec<u32>,
    ref_counts: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> BlockPool {
        // Popping from the end hands out low ids first.
        let free = (0..num_blocks as u32).rev().collect();
        BlockPool { free, ref_counts: vec![0; num_blocks] }
    }

    pub fn capacity(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Takes a free block with one reference, or `None` when every block is in use.
    pub fn allocate(&mut self) -> Option<u32> {
        let id = self.free.pop()?;
        self.ref_counts[id as usize] = 1;
        Some(id)
    }

    /// Adds a reference to a block in use.
    pub fn retain(&mut self, id: u32) -> Result<()> {
        match self.ref_counts.get_mut(id as usize) {
            Some(count) if *count > 0 => {
                *count += 1;
                Ok(())
            }
            _ => Err(Error::Value(format!("block {id} is not allocated"))),
        }
    }

    /// Drops a reference; the block is free again when none is left.
    pub fn release(&mut self, id: u32) -> Result<()> {
        match self.ref_counts.get_mut(id as usize) {
            Some(count) if *count > 0 => {
                *count -= 1;
                if *count == 0 {
                    self.free.push(id);
                }
                Ok(())
            }
            _ => Err(Error::Value(format!("block {id} is not allocated"))),
        }
    }

    pub fn ref_count(&self, id: u32) -> u32 {
        self.ref_counts[id as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_back_when_the_last_reference_goes() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        assert_eq!(pool.allocate(), None);
        pool.retain(a).unwrap();
        pool.release(a).unwrap();
        assert_eq!(pool.num_free(), 0);
        pool.release(a).unwrap();
        pool.release(b).unwrap();
        assert_eq!(pool.num_free(), 2);
        assert!(pool.release(a).is_err());
    }
}

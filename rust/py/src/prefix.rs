//! `PrefixCache`: the block pool and prefix trie of the KV cache on their own, without a model, for
//! tests and benchmarks; and the statistics dict shared with `Model.cache_stats`.

use std::sync::Arc;

use oxibonsai_core::kv::{CacheStats, PrefixCache as CoreCache, BLOCK_TOKENS};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;
use crate::token_ids::token_ids;

/// The statistics as a dict (counters, then gauges).
pub fn stats_dict<'py>(py: Python<'py>, s: &CacheStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("queries", s.queries)?;
    d.set_item("hits", s.hits)?;
    d.set_item("queried_tokens", s.queried_tokens)?;
    d.set_item("hit_tokens", s.hit_tokens)?;
    let rate = if s.queried_tokens > 0 { s.hit_tokens as f64 / s.queried_tokens as f64 } else { 0.0 };
    d.set_item("hit_rate", rate)?;
    d.set_item("inserted_blocks", s.inserted_blocks)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("cached_blocks", s.cached_blocks)?;
    d.set_item("idle_blocks", s.idle_blocks)?;
    d.set_item("free_blocks", s.free_blocks)?;
    d.set_item("capacity_blocks", s.capacity_blocks)?;
    d.set_item("bytes_in_use", s.bytes_in_use)?;
    d.set_item("capacity_bytes", s.capacity_bytes)?;
    d.set_item("host_capacity_blocks", s.host_capacity_blocks)?;
    d.set_item("host_cached_blocks", s.host_cached_blocks)?;
    d.set_item("host_free_blocks", s.host_free_blocks)?;
    d.set_item("host_hit_tokens", s.host_hit_tokens)?;
    d.set_item("demotions", s.demotions)?;
    d.set_item("promotions", s.promotions)?;
    d.set_item("prefetched_blocks", s.prefetched_blocks)?;
    d.set_item("host_evictions", s.host_evictions)?;
    Ok(d)
}

/// A pool of `num_blocks` KV blocks (16 tokens each) and the trie of cached full blocks, without KV
/// storage. Blocks are held by callers through `acquire`, `allocate` and `insert`, and given back with
/// `release`; cached blocks nobody holds are evicted least recently used first, leaves before parents.
#[pyclass(module = "oxibonsai._core")]
pub struct PrefixCache {
    inner: CoreCache,
}

fn salt_arc(salt: Option<&str>) -> Option<Arc<str>> {
    salt.map(Arc::from)
}

#[pymethods]
impl PrefixCache {
    /// `block_bytes` only feeds the byte statistics.
    #[new]
    #[pyo3(signature = (num_blocks, block_bytes=0))]
    fn new(num_blocks: usize, block_bytes: usize) -> PyResult<PrefixCache> {
        if num_blocks == 0 || num_blocks > u32::MAX as usize {
            return Err(PyValueError::new_err(format!("num_blocks must be in 1..2**32, got {num_blocks}")));
        }
        Ok(PrefixCache { inner: CoreCache::new(num_blocks, block_bytes) })
    }

    #[getter]
    fn block_tokens(&self) -> usize {
        BLOCK_TOKENS
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }

    #[getter]
    fn num_cached(&self) -> usize {
        self.inner.num_cached()
    }

    /// Cached blocks nobody holds.
    #[getter]
    fn num_idle(&self) -> usize {
        self.inner.num_idle()
    }

    /// Free blocks plus idle cached ones.
    #[getter]
    fn num_available(&self) -> usize {
        self.inner.num_available()
    }

    /// Tokens of the longest cached prefix of `tokens` (whole blocks, at most `max_blocks`); changes
    /// nothing.
    #[pyo3(name = "match", signature = (tokens, salt=None, max_blocks=None))]
    fn match_prefix(
        &self,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&str>,
        max_blocks: Option<usize>,
    ) -> PyResult<usize> {
        let tokens = token_ids(tokens)?;
        Ok(self.inner.lookup(&tokens, salt, max_blocks.unwrap_or(usize::MAX)).cached_tokens)
    }

    /// Holds the blocks of the longest cached prefix of `tokens` and returns them (counted as a query).
    #[pyo3(signature = (tokens, salt=None, max_blocks=None))]
    fn acquire(
        &mut self,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&str>,
        max_blocks: Option<usize>,
    ) -> PyResult<Vec<u32>> {
        let tokens = token_ids(tokens)?;
        Ok(self.inner.acquire(&tokens, salt, max_blocks.unwrap_or(usize::MAX)).block_ids)
    }

    /// A block for the caller, evicting if none is free; None when nothing is free or evictable.
    fn allocate(&mut self) -> Option<u32> {
        self.inner.allocate()
    }

    /// Caches the chain `blocks` (block i holds `tokens[16*i:16*(i+1)]`) and returns the blocks the caller
    /// now holds: a block whose contents were already cached is replaced by the cached one.
    #[pyo3(signature = (tokens, blocks, salt=None))]
    fn insert(
        &mut self,
        tokens: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        salt: Option<&str>,
    ) -> PyResult<Vec<u32>> {
        let tokens = token_ids(tokens)?;
        // Block ids are read like token ids (a long list of ints, the fast path).
        let mut blocks = token_ids(blocks)?;
        self.inner.insert_chain(&tokens, &mut blocks, salt_arc(salt).as_ref()).map_err(to_py)?;
        Ok(blocks)
    }

    /// Gives back one hold on each block (all checked first).
    fn release(&mut self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let blocks = token_ids(blocks)?;
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &b in &blocks {
            *counts.entry(b).or_default() += 1;
        }
        if let Some((b, _)) = counts.iter().find(|(&b, &n)| self.inner.users(b) < n) {
            return Err(PyValueError::new_err(format!("block {b} is not held that many times")));
        }
        for b in blocks {
            self.inner.release(b).map_err(to_py)?;
        }
        Ok(())
    }

    /// Evicts up to `n` idle cached blocks; returns them in eviction order.
    #[pyo3(signature = (n=1))]
    fn evict(&mut self, n: usize) -> Vec<u32> {
        self.inner.evict(n)
    }

    /// Drops every idle cached block; returns how many.
    fn reset(&mut self) -> usize {
        self.inner.reset()
    }

    /// Holders of `block`, not counting the cache itself.
    fn users(&self, block: u32) -> u32 {
        self.inner.users(block)
    }

    fn is_cached(&self, block: u32) -> bool {
        self.inner.is_cached(block)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner.stats())
    }

    /// Raises ValueError if any internal invariant is broken (for tests).
    fn check(&self) -> PyResult<()> {
        self.inner.check().map_err(to_py)
    }
}

/// The 128-bit keys of the full 16-token blocks at the start of `tokens`, chained as the prefix trie
/// chains them, for cache salt `salt`, under `seed` (for routers that index what each replica holds).
#[pyfunction]
#[pyo3(signature = (tokens, *, salt=None, seed=0))]
pub fn block_hashes(tokens: &Bound<'_, PyAny>, salt: Option<&str>, seed: u64) -> PyResult<Vec<u128>> {
    let tokens = token_ids(tokens)?;
    Ok(oxibonsai_core::kv::hash::chain_keys(seed, &tokens, salt).into_iter().map(|k| k.0).collect())
}

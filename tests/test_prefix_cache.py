"""The prefix cache's pool and trie through ``oxibonsai._core.PrefixCache``: Hypothesis drives random
acquire / allocate / insert / release / evict / reset sequences on it and on the pure-Python model in
``prefix_model.py``; both must agree on every block id and statistic, and the invariants must hold."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prefix_model import BLOCK, PyPrefixCache

from oxibonsai._core import PrefixCache

# Prompts are made of a few fixed blocks, so prefixes are shared often.
PIECES = [[p * 100 + i for i in range(BLOCK)] for p in range(4)]
prompts = st.builds(
    lambda pieces, tail: [t for p in pieces for t in PIECES[p]] + tail,
    st.lists(st.integers(0, 3), max_size=5),
    st.lists(st.integers(0, 999), max_size=BLOCK - 1),
)
salts = st.sampled_from([None, "tenant-a", "tenant-b"])

_COUNTERS = ("queries", "hits", "queried_tokens", "hit_tokens", "inserted_blocks", "evictions")
_GAUGES = ("cached_blocks", "idle_blocks", "free_blocks", "capacity_blocks")


class _Request:
    def __init__(self, tokens: list[int], salt: str | None, blocks: list[int]) -> None:
        self.tokens, self.salt, self.blocks = tokens, salt, blocks


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12))
    def start(self, num_blocks: int) -> None:
        self.rust = PrefixCache(num_blocks)
        self.model = PyPrefixCache(num_blocks)
        self.requests: list[_Request] = []

    def held(self) -> set[int]:
        return {b for r in self.requests for b in r.blocks}

    @rule(tokens=prompts, salt=salts)
    def acquire(self, tokens: list[int], salt: str | None) -> None:
        assert self.rust.match(tokens, salt) == self.model.match(tokens, salt)
        got = self.rust.acquire(tokens, salt)
        assert got == self.model.acquire(tokens, salt)
        self.requests.append(_Request(tokens, salt, got))

    @precondition(lambda self: any(len(r.blocks) < len(r.tokens) // BLOCK for r in self.requests))
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        growing = [r for r in self.requests if len(r.blocks) < len(r.tokens) // BLOCK]
        r = data.draw(st.sampled_from(growing))
        held = self.held()
        block = self.rust.allocate()
        assert block == self.model.allocate()
        if block is not None:
            assert block not in held, "a held block was handed out again"
            r.blocks.append(block)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.requests))
        got = self.rust.insert(r.tokens, r.blocks, r.salt)
        assert got == self.model.insert(r.tokens, r.blocks, r.salt)
        r.blocks = got

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        r = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.rust.release(r.blocks)
        self.model.release(r.blocks)

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        held = self.held()
        got = self.rust.evict(n)
        assert got == self.model.evict(n)
        assert not held & set(got), "a held block was evicted"

    @rule()
    def reset(self) -> None:
        assert self.rust.reset() == self.model.reset()

    @invariant()
    def agree_and_hold_together(self) -> None:
        self.rust.check()
        rust, model = self.rust.stats(), self.model.stats()
        for name in _COUNTERS + _GAUGES:
            assert rust[name] == model[name], name
        held = self.held()
        for b in held:
            assert self.rust.users(b) >= 1
        counts: dict[int, int] = {}
        for r in self.requests:
            for b in r.blocks:
                counts[b] = counts.get(b, 0) + 1
        for b in range(self.rust.capacity):
            assert self.rust.users(b) == self.model.users(b) == counts.get(b, 0)
            assert self.rust.is_cached(b) == self.model.is_cached(b)
        in_use = sum(1 for b in range(self.rust.capacity) if counts.get(b) or self.rust.is_cached(b))
        assert self.rust.num_free + in_use == self.rust.capacity

    def teardown(self) -> None:
        for r in self.requests:
            self.rust.release(r.blocks)
        assert self.rust.num_available == self.rust.capacity, "a block leaked"
        self.rust.reset()
        assert self.rust.num_free == self.rust.capacity and self.rust.num_cached == 0


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_numpy_and_list_prompts_are_the_same(rng):
    cache = PrefixCache(8, block_bytes=10)
    tokens = rng.integers(0, 50_000, 3 * BLOCK + 5).astype(np.uint32)
    blocks = [cache.allocate() for _ in range(3)]
    assert cache.insert(tokens, blocks) == blocks
    assert cache.match(tokens) == cache.match(tokens.tolist()) == 3 * BLOCK
    assert cache.match(tokens[::2].copy()) == 0
    assert cache.match(tokens, max_blocks=2) == 2 * BLOCK
    assert cache.match(tokens, salt="x") == 0
    stats = cache.stats()
    assert stats["bytes_in_use"] == 30 and stats["capacity_bytes"] == 80


def test_bad_calls_raise_and_change_nothing(rng):
    cache = PrefixCache(4)
    tokens = rng.integers(0, 1000, 2 * BLOCK).tolist()
    a, b = cache.allocate(), cache.allocate()
    with pytest.raises(ValueError):
        cache.insert(tokens, [a, a])
    with pytest.raises(ValueError):
        cache.insert(tokens, [a, 3])  # block 3 is not held
    with pytest.raises(ValueError):
        cache.insert(tokens[:20], [a, b])  # too few tokens
    with pytest.raises(ValueError):
        cache.release([a, a])
    with pytest.raises(ValueError):
        PrefixCache(0)
    with pytest.raises(TypeError):
        cache.insert(tokens, [a, "b"])
    with pytest.raises(OverflowError):
        cache.release([a, -1])
    with pytest.raises(TypeError):
        cache.release("ab")
    assert cache.num_cached == 0 and cache.users(a) == cache.users(b) == 1
    cache.check()


def test_block_ids_may_be_a_list_a_tuple_or_a_uint32_array(rng):
    cache = PrefixCache(12)
    chains = []
    for form in (list, tuple, lambda ids: np.array(ids, dtype=np.uint32)):
        tokens = rng.integers(0, 50_000, 2 * BLOCK).tolist()
        held = [cache.allocate(), cache.allocate()]
        assert cache.insert(tokens, form(held)) == held
        cache.release(form(held))
        chains.append(held)
    assert cache.num_cached == 6 and all(cache.users(b) == 0 for c in chains for b in c)
    cache.check()


def test_the_same_prompt_computed_twice_is_stored_once(rng):
    cache = PrefixCache(8)
    tokens = rng.integers(0, 1000, 2 * BLOCK).tolist()
    first = cache.insert(tokens, [cache.allocate(), cache.allocate()])
    second = cache.insert(tokens, [cache.allocate(), cache.allocate()])
    assert second == first and cache.num_free == 6
    assert [cache.users(b) for b in first] == [2, 2]

"""The prefix cache's trie and pool: ``oxibonsai._core.PrefixCache`` (Rust) against the pure-Python
model with the same rules (``tests/prefix_model.py``: BLAKE2b keys, a dict of nodes, a heap of idle
leaves), for prompts of 64 to 4,096 blocks (16 tokens each). Operations: ``lookup`` (the longest cached
prefix of a fully cached prompt), ``insert`` (cache a new prompt's chain of blocks) and ``evict`` (evict
every block of an idle chain, leaf first). Both take the prompt as a Python list; ``rust-numpy`` passes a
uint32 array instead (no per-token conversion). Target: Rust >= 20x faster.

    python -m pytest benches/bench_prefix_cache.py --benchmark-only --benchmark-group-by=group
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from prefix_model import BLOCK, PyPrefixCache

from oxibonsai._core import PrefixCache

SIZES = (64, 512, 4096)
IMPLS = ("rust", "rust-numpy", "python")


def make(impl: str, blocks: int) -> Any:
    return PyPrefixCache(blocks) if impl == "python" else PrefixCache(blocks)


def prompt(impl: str, blocks: int) -> Any:
    ids = np.random.default_rng(blocks).integers(0, 150_000, blocks * BLOCK, dtype=np.uint32)
    return ids if impl == "rust-numpy" else ids.tolist()


def filled(impl: str, blocks: int, tokens: Any) -> Any:
    """A cache whose only content is the idle chain of `tokens`."""
    cache = make(impl, blocks)
    chain = cache.insert(tokens, [cache.allocate() for _ in range(blocks)])
    cache.release(chain)
    return cache


def rounds(blocks: int) -> int:
    return max(20, 20_000 // blocks)


def run(benchmark: Any, setup: Callable[[], Any], op: Callable[[Any], object], blocks: int) -> None:
    benchmark.pedantic(op, setup=lambda: ((setup(),), {}), rounds=rounds(blocks), warmup_rounds=1)


@pytest.mark.parametrize("blocks", SIZES)
@pytest.mark.parametrize("impl", IMPLS)
def test_lookup(benchmark: Any, impl: str, blocks: int) -> None:
    benchmark.group = f"lookup-{blocks}"
    tokens = prompt(impl, blocks)
    cache = filled(impl, blocks, tokens)
    assert cache.match(tokens) == blocks * BLOCK
    benchmark.pedantic(cache.match, args=(tokens,), rounds=rounds(blocks), warmup_rounds=1)


@pytest.mark.parametrize("blocks", SIZES)
@pytest.mark.parametrize("impl", IMPLS)
def test_insert(benchmark: Any, impl: str, blocks: int) -> None:
    benchmark.group = f"insert-{blocks}"
    tokens = prompt(impl, blocks)

    def setup() -> tuple[Any, list[int]]:
        cache = make(impl, blocks)
        return cache, [cache.allocate() for _ in range(blocks)]

    run(benchmark, setup, lambda s: s[0].insert(tokens, s[1]), blocks)


@pytest.mark.parametrize("blocks", SIZES)
@pytest.mark.parametrize("impl", IMPLS)
def test_evict(benchmark: Any, impl: str, blocks: int) -> None:
    benchmark.group = f"evict-{blocks}"
    tokens = prompt(impl, blocks)

    def evict_all(cache: Any) -> None:
        assert len(cache.evict(blocks)) == blocks

    run(benchmark, lambda: filled(impl, blocks, tokens), evict_all, blocks)

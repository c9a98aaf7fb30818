"""A pure-Python model of ``oxibonsai.PrefixCache`` with the same rules, for the property tests and the
benchmark: a free list used as a stack (low ids first), a reference count per block (the trie holds one
on every cached block), nodes keyed by a 128-bit hash (BLAKE2b) of (parent key, salt, token ids) and
confirmed by comparing them, and a heap of idle leaves ordered by (last use, block id), stale entries
skipped. A tick advances on every acquire, every inserted block and every released block, as in Rust,
so both pick the same victims and hand out the same block ids."""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

BLOCK = 16


@dataclass
class _Node:
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    salt: str | None
    block: int
    children: int = 0
    last_used: int = 0
    idle: bool = False

    def evictable(self) -> bool:
        return self.idle and self.children == 0


def block_key(parent: bytes | None, tokens: Sequence[int], salt: str | None) -> bytes:
    h = blake2b(digest_size=16)
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    h.update(b"\x00" if salt is None else b"\x01" + len(salt).to_bytes(8, "little") + salt.encode())
    h.update(array("I", tokens).tobytes())
    return h.digest()


class PyPrefixCache:
    def __init__(self, num_blocks: int) -> None:
        self.capacity = num_blocks
        self.free = list(reversed(range(num_blocks)))
        self.refs = [0] * num_blocks
        self.nodes: dict[bytes, _Node] = {}
        self.by_block: dict[int, _Node] = {}
        self.heap: list[tuple[int, int]] = []
        self.idle = 0
        self.tick = 0
        self.counters = dict(
            queries=0, hits=0, queried_tokens=0, hit_tokens=0, inserted_blocks=0, evictions=0
        )

    # -- queries --------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.nodes)

    @property
    def num_available(self) -> int:
        return len(self.free) + self.idle

    def users(self, block: int) -> int:
        return self.refs[block] - (block in self.by_block)

    def is_cached(self, block: int) -> bool:
        return block in self.by_block

    def _lookup(self, tokens: Sequence[int], salt: str | None, max_blocks: int | None) -> list[_Node]:
        found: list[_Node] = []
        parent = None
        n = len(tokens) // BLOCK if max_blocks is None else min(max_blocks, len(tokens) // BLOCK)
        for i in range(n):
            chunk = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
            node = self.nodes.get(block_key(parent, chunk, salt))
            if node is None or node.parent != parent or node.tokens != chunk or node.salt != salt:
                break
            found.append(node)
            parent = node.key
        return found

    def match(self, tokens: Sequence[int], salt: str | None = None, max_blocks: int | None = None) -> int:
        return BLOCK * len(self._lookup(tokens, salt, max_blocks))

    def stats(self) -> dict[str, int]:
        return dict(
            self.counters,
            cached_blocks=len(self.nodes),
            idle_blocks=self.idle,
            free_blocks=len(self.free),
            capacity_blocks=self.capacity,
        )

    # -- changes --------------------------------------------------------------------------------

    def acquire(
        self, tokens: Sequence[int], salt: str | None = None, max_blocks: int | None = None
    ) -> list[int]:
        self.tick += 1
        found = self._lookup(tokens, salt, max_blocks)
        for node in found:
            self._take(node)
        c = self.counters
        c["queries"] += 1
        c["hits"] += bool(found)
        c["queried_tokens"] += len(tokens)
        c["hit_tokens"] += BLOCK * len(found)
        return [n.block for n in found]

    def allocate(self) -> int | None:
        if not self.free and self._evict_one() is None:
            return None
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], salt: str | None = None) -> list[int]:
        if len(tokens) < BLOCK * len(blocks):
            raise ValueError("too few tokens for the blocks")
        cached = [n.block for n in self._lookup(tokens, salt, len(blocks))]
        seen: set[int] = set()
        for i, b in enumerate(blocks):
            if i < len(cached) and cached[i] == b:
                ok = self.users(b) > 0
            else:
                ok = self._sole_holder(b) and b not in seen
                seen.add(b)
            if not ok:
                raise ValueError(f"block {b} cannot be inserted here")
        out = list(blocks)
        parent = None
        for i, b in enumerate(blocks):
            self.tick += 1
            chunk = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
            key = block_key(parent, chunk, salt)
            node = self.nodes.get(key)
            if node is not None and (node.parent != parent or node.tokens != chunk or node.salt != salt):
                return out
            if node is None:
                if parent is not None and parent not in self.nodes:
                    return out
                self.refs[b] += 1
                node = _Node(key, parent, chunk, salt, b, last_used=self.tick)
                if parent is not None:
                    p = self.nodes[parent]
                    p.children += 1
                self.nodes[key] = node
                self.by_block[b] = node
                self.counters["inserted_blocks"] += 1
            elif node.block != b:
                self._take(node)
                self._unref(b)
                out[i] = node.block
            else:
                node.last_used = self.tick
            parent = key
        return out

    def release(self, blocks: Sequence[int]) -> None:
        for b in set(blocks):
            if not 0 <= b < self.capacity or self.users(b) < list(blocks).count(b):
                raise ValueError(f"block {b} is not held that many times")
        for b in blocks:
            self.tick += 1
            self._unref(b)
            node = self.by_block.get(b)
            if node is not None and self.refs[b] == 1:
                self.idle += 1
                node.idle = True
                node.last_used = self.tick
                self._push_if_evictable(node)

    def evict(self, n: int = 1) -> list[int]:
        out = []
        while len(out) < n and (b := self._evict_one()) is not None:
            out.append(b)
        return out

    def reset(self) -> int:
        return len(self.evict(self.capacity))

    # -- internals ------------------------------------------------------------------------------

    def _sole_holder(self, block: int) -> bool:
        return 0 <= block < self.capacity and block not in self.by_block and self.refs[block] == 1

    def _take(self, node: _Node) -> None:
        if node.idle:
            self.idle -= 1
            node.idle = False
        node.last_used = self.tick
        self.refs[node.block] += 1

    def _unref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def _push_if_evictable(self, node: _Node) -> None:
        if node.evictable():
            heapq.heappush(self.heap, (node.last_used, node.block))

    def _evict_one(self) -> int | None:
        while self.heap:
            last_used, block = heapq.heappop(self.heap)
            node = self.by_block.get(block)
            if node is None or not node.evictable() or node.last_used != last_used:
                continue  # stale: the node changed since it was pushed
            del self.nodes[node.key], self.by_block[block]
            self.idle -= 1
            self._unref(block)
            self.counters["evictions"] += 1
            if node.parent is not None:
                parent = self.nodes[node.parent]
                parent.children -= 1
                self._push_if_evictable(parent)
            return block
        return None

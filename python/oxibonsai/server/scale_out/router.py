"""``PrefixAffinityRouter``: a Ray Serve request router that sends a request to the engine replica most
likely to hold the longest prefix of its prompt in its prefix cache, unless that replica is clearly
busier than another.

The index is approximate, kept by the router from what it routed (as SGLang's cache-aware router does):
for each replica, the keys of the 16-token blocks of prompts sent there, hashed exactly as the Rust
prefix trie chains its keys (``_core.block_hashes``: the same hash over token ids, parent key and cache
salt, so tenants with different salts never share), in a least-recently-used set bounded by
``index_blocks``. Replicas never report their caches: that would cost a round trip per decision or a
stream of events, while the router already sees every prompt; what it cannot see is a replica evicting
a block, which the LRU bound approximates (a stale entry costs one miss, never a wrong answer: the
replica's own trie confirms every hit).

Choice: among replicas whose queue is at most ``imbalance`` longer than the shortest (the app sets it
to one batch, ``max_num_seqs``), the one whose index matches the most leading blocks (ties: the shorter
queue); with no match anywhere, the shortest queue. The others follow as fallbacks in order of queue
length."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from oxibonsai._core import block_hashes
from oxibonsai.server.scale_out.protocol import ReplicaRequest

DEFAULT_INDEX_BLOCKS = 1 << 16
DEFAULT_IMBALANCE = 2
ROUTER_SEED = 0x0B5E_D0C5


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(
        self, index_blocks: int = DEFAULT_INDEX_BLOCKS, imbalance: int = DEFAULT_IMBALANCE, **_: Any
    ) -> None:
        self._capacity = index_blocks
        self._imbalance = imbalance
        self._index: dict[ReplicaID, OrderedDict[int, None]] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        keys = _request_keys(pending_request)
        loads = {r.replica_id: self._load(r.replica_id) for r in candidate_replicas}
        least = min(loads.values())
        eligible = [r for r in candidate_replicas if loads[r.replica_id] <= least + self._imbalance]
        random.shuffle(eligible)  # ties between equal replicas go either way
        best = max(eligible, key=lambda r: (self._matched(r.replica_id, keys), -loads[r.replica_id]))
        rest = sorted((r for r in candidate_replicas if r is not best), key=lambda r: loads[r.replica_id])
        return [[best], *([r] for r in rest)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        index = self._index.setdefault(replica_id, OrderedDict())
        for key in _request_keys(pending_request):
            index[key] = None
            index.move_to_end(key)
        while len(index) > self._capacity:
            index.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [r for r in self._index if r not in live]:
            del self._index[gone]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.pop(replica_id, None)

    def _matched(self, replica_id: ReplicaID, keys: list[int]) -> int:
        index = self._index.get(replica_id)
        if not index:
            return 0
        n = 0
        for key in keys:
            if key not in index:
                break
            n += 1
        return n

    def _load(self, replica_id: ReplicaID) -> int:
        queue_len = self.replica_queue_len_cache.get(replica_id)
        return int(queue_len) if queue_len is not None else 0


def _request_keys(pending: PendingRequest | None) -> list[int]:
    if pending is None or not pending.args or not isinstance(pending.args[0], ReplicaRequest):
        return []
    return _keys(pending.args[0])


def _keys(request: ReplicaRequest) -> list[int]:
    # The last prompt token is always computed, so only blocks before it can be cache hits.
    ids = request.prompt_token_ids[:-1]
    return block_hashes(ids, salt=request.cache_salt, seed=ROUTER_SEED)

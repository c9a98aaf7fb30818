"""``MetricsBoard``: a small Ray actor where every engine replica posts its metrics once a second
(Prometheus text already labelled with its replica id, its prefix-cache statistics and its actor name),
so the ingress can answer ``/metrics`` for all replicas without a broadcast. Posts older than
``max_age_s`` (a replica that died or was replaced) are left out of snapshots."""

from __future__ import annotations

import time
from typing import Any

import ray


@ray.remote(num_cpus=0)
class MetricsBoard:
    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, dict[str, Any]]] = {}

    def post(self, replica: str, payload: dict[str, Any]) -> None:
        self._posts[replica] = (time.monotonic(), payload)

    def snapshot(self, max_age_s: float = 5.0) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        return {r: p for r, (t, p) in self._posts.items() if now - t <= max_age_s}


def board_name(app_name: str) -> str:
    return f"oxibonsai-metrics-{app_name}"

"""``EngineReplica``: one ``AsyncLLM`` as a Ray Serve deployment replica. ``generate`` is an async
generator: ``ACCEPTED`` as soon as the engine has queued the request (its refusals raise before that;
a request's grammar compiles in a worker thread first), then every ``RequestOutput``; when the caller
goes away Serve cancels the generator and the request is aborted, freeing its KV blocks.
``check_health`` fails once the engine has died, so Serve replaces the replica. With
``--prefix-cache-file`` each replica starts from the saved cache; none saves it at shutdown, since
prefix routing leaves each with a part of the prompts. A background thread
posts the replica's metrics to the ``MetricsBoard`` once a second."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.outputs import RequestOutput
from oxibonsai.server.metrics import vllm_aliases
from oxibonsai.server.prefix_cache_file import load_saved_cache
from oxibonsai.server.scale_out.board import board_name
from oxibonsai.server.scale_out.prometheus import with_label
from oxibonsai.server.scale_out.protocol import ACCEPTED, ReplicaRequest

POST_INTERVAL_S = 1.0
BOARD_NAMESPACE = "oxibonsai"


class EngineReplica:
    def __init__(
        self,
        model: str,
        engine_args: dict[str, Any],
        app_name: str,
        served_model_name: str,
        prefix_cache_file: str | None = None,
    ) -> None:
        self.engine = AsyncLLM(model, **engine_args)
        if prefix_cache_file is not None:  # loaded by every replica; saved by none (each holds a part)
            load_saved_cache(self.engine, prefix_cache_file)
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self._served_name = served_model_name
        self._board = ray.get_actor(board_name(app_name), namespace=BOARD_NAMESPACE)
        self._actor_name = ray.get_runtime_context().get_actor_name()
        self._stop = threading.Event()
        threading.Thread(target=self._post_forever, name="oxibonsai-metrics", daemon=True).start()

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestOutput | str]:
        # A grammar compiles off the replica's event loop (a refusal raises before ACCEPTED).
        await asyncio.to_thread(self.engine.prepare_structured_output, request.params)
        stream = self.engine.generate(
            request.prompt, request.params, request_id=request.request_id, priority=request.priority
        )
        try:
            yield ACCEPTED
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the engine is not running")

    def payload(self) -> dict[str, Any]:
        """This replica's metrics: labelled Prometheus text, cache statistics and its actor's name."""
        snapshot, cache = self.engine.metrics(), self.engine.cache_stats()
        text = self.engine.prometheus_metrics()
        text += vllm_aliases(snapshot, cache, self._served_name, self.engine.block_size, engine=self.replica)
        return {
            "text": with_label(text, "replica", self.replica),
            "cache": cache,
            "num_running": snapshot["num_running"],
            "num_waiting": snapshot["num_waiting"],
            "actor_name": self._actor_name,
        }

    def _post_forever(self) -> None:
        while not self._stop.wait(POST_INTERVAL_S):
            if not self.engine.is_running:
                return
            try:
                self._board.post.remote(self.replica, self.payload())
            except Exception:  # the board is gone (the app is shutting down): stop posting
                return

    def __del__(self) -> None:
        self._stop.set()
        self.engine.shutdown()

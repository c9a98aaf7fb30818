"""``RemoteEngine``: what the OpenAI server needs from an engine (``generate``, the tokenizer, the
context length, metrics), served by Ray Serve engine replicas. The server code runs unchanged over it:
``generate`` returns a ``RemoteStream`` whose ``accepted()`` waits for the replica to queue the request,
so a replica's refusal (a full queue, a bad prompt, Serve's own backpressure) raises before any response
byte, as ``AsyncLLM.generate`` raises at once. A replica lost mid-request ends its streams with
``EngineDeadError`` (a 5xx), never a hang."""

from __future__ import annotations

import threading
import time
from typing import Any

import ray
from ray.serve.exceptions import BackPressureError

from oxibonsai._core import QueueFull
from oxibonsai.async_llm import EngineDeadError
from oxibonsai.outputs import RequestOutput
from oxibonsai.sampling_params import SamplingParams
from oxibonsai.server.scale_out.prometheus import merge
from oxibonsai.server.scale_out.protocol import ACCEPTED, ReplicaRequest
from oxibonsai.tokenizer import Tokenizer

BOARD_POLL_S = 1.0
STARTUP_GRACE_S = 120.0

_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)


def _translate(error: BaseException) -> BaseException:
    """Ray's wrappers turned back into the errors the server maps to HTTP statuses."""
    if isinstance(error, BackPressureError):
        return QueueFull(f"every replica's queue is full: retry later ({error})")
    if isinstance(error, _LOST):
        return EngineDeadError(f"the engine replica serving this request was lost: {error}")
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause
        return cause if isinstance(cause, BaseException) else EngineDeadError(str(error))
    return error


class RemoteStream:
    """One request's outputs from a replica: ``async for`` as over an ``AsyncLLM`` stream."""

    def __init__(self, response: Any, request_id: str) -> None:
        self.request_id = request_id
        self._response = response
        self.done = False

    async def accepted(self) -> None:
        """Waits until the replica has queued the request; raises its refusal otherwise."""
        first = await self._next()
        if first != ACCEPTED:
            raise EngineDeadError(f"the replica answered {first!r} before accepting the request")

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self._next()
        assert isinstance(out, RequestOutput)
        return out

    async def _next(self) -> Any:
        if self.done:
            raise StopAsyncIteration
        try:
            return await self._response.__anext__()
        except StopAsyncIteration:
            self.done = True
            raise
        except Exception as error:
            self.done = True
            raise _translate(error) from error

    async def aclose(self) -> None:
        """Cancels the replica's generator, which aborts the request there."""
        if not self.done:
            self.done = True
            self._response.cancel()


class RemoteEngine:
    """The ``AsyncLLM`` face of a deployment of engine replicas, for ``build_app``. A thread reads the
    metrics board once a second, so routes never wait on Ray for it; ``is_running`` turns False once no
    replica has posted for a while (every one lost, Serve still replacing them), after a start-up grace
    period in which replicas load their model."""

    def __init__(
        self,
        handle: Any,
        board: Any,
        tokenizer: Tokenizer,
        *,
        max_model_len: int,
        block_size: int,
        default_sampling_fields: dict[str, Any] | None = None,
    ) -> None:
        self._handle = handle.options(stream=True)
        self._board = board
        self.tokenizer = tokenizer
        self.default_sampling_fields = dict(default_sampling_fields or {})
        self.max_model_len = max_model_len
        self.block_size = block_size
        self._posts: dict[str, dict[str, Any]] = {}
        self._started = time.monotonic()
        threading.Thread(target=self._watch_board, name="oxibonsai-board", daemon=True).start()

    @property
    def is_running(self) -> bool:
        return bool(self._posts) or time.monotonic() - self._started < STARTUP_GRACE_S

    def _watch_board(self) -> None:
        while True:
            try:
                self._posts = ray.get(self._board.snapshot.remote(), timeout=5 * BOARD_POLL_S)
            except Exception:  # the board is gone (the app is shutting down) or slow: no replicas known
                self._posts = {}
            time.sleep(BOARD_POLL_S)

    def generate(
        self,
        prompt: dict[str, Any],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str,
        priority: int = 0,
    ) -> RemoteStream:
        request = ReplicaRequest(prompt, sampling_params or SamplingParams(), request_id, priority)
        return RemoteStream(self._handle.generate.remote(request), request_id)

    def replicas(self) -> dict[str, dict[str, Any]]:
        """Each live replica's latest metrics post (see ``MetricsBoard``), at most a second old."""
        return dict(self._posts)

    def metrics_text(self) -> str:
        """Every replica's engine metrics, ``replica``-labelled, as one Prometheus exposition."""
        return merge([post["text"] for post in self.replicas().values()])

    def cache_stats(self) -> dict[str, Any]:
        """The replicas' prefix-cache counters summed (the cluster-wide hit rate among them)."""
        totals: dict[str, Any] = {}
        for post in self.replicas().values():
            for key, value in post["cache"].items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    totals[key] = totals.get(key, 0) + value
        queried = totals.get("queried_tokens", 0)
        totals["hit_rate"] = totals.get("hit_tokens", 0) / queried if queried else 0.0
        return totals

    def shutdown(self) -> None:
        """Nothing to stop here: Serve owns the replicas."""

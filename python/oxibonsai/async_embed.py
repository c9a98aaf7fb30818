"""Embedding jobs for ``AsyncLLM``'s step loop: an ``embed`` call's prompts, each a prefill outside the
scheduler (``LLM._embedding_steps``), run one chunk of ``max_num_batched_tokens`` tokens between two
engine steps, so running requests keep decoding while a long prompt is embedded instead of waiting for
its whole prefill. A job owns its prompts' generators and the caller's asyncio future; only the step
loop advances it, under the engine lock.

A chunk runs only when the KV cache can give it its blocks (free or evictable), as the scheduler's
own requests finish or are preempted; with nothing else running, a chunk the cache cannot hold fails
the job with a ``ValueError``. Closing a job (cancelled, failed, the engine shut down) closes its
generators, which frees the sequence a prompt holds."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Generator, Sequence
from typing import Any

from oxibonsai.outputs import EmbeddingRequestOutput

EmbeddingSteps = Generator[int, None, EmbeddingRequestOutput]


class EmbedJob:
    """One ``AsyncLLM.embed`` call: its prompts' steps in order, the outputs so far, and the future its
    caller awaits. ``cancelled`` is set from the caller's thread; the loop drops the job when it sees it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, steps: Sequence[EmbeddingSteps]) -> None:
        self.loop = loop
        self.future: asyncio.Future[list[EmbeddingRequestOutput]] = loop.create_future()
        self._steps = deque(steps)
        self._outputs: list[EmbeddingRequestOutput] = []
        self._need: int | None = None  # blocks the next chunk takes, once its generator said so
        self.cancelled = False

    def advance(self, available_blocks: int, engine_idle: bool) -> bool:
        """Runs the next chunk if the cache has its blocks (else waits for another call); True once
        every prompt is embedded. ``engine_idle``: no request runs, so no blocks will be freed (waiting
        requests hold none) and a chunk that does not fit never will (a ``ValueError``)."""
        need = self._next_need()
        if need is None:
            return True
        if need > available_blocks:
            if engine_idle:
                raise ValueError(
                    f"the KV cache cannot hold this embedding prompt: a chunk needs {need} more blocks, "
                    f"{available_blocks} are free; raise kv_cache_blocks or shorten the prompt"
                )
            return False
        steps = self._steps[0]
        try:
            self._need = steps.send(None)
        except StopIteration as done:
            self._outputs.append(done.value)
            self._steps.popleft()
            self._need = None
        return not self._steps

    def _next_need(self) -> int | None:
        """The blocks the next chunk takes (starting the next prompt's generator if need be), or None
        when every prompt is done."""
        while self._need is None and self._steps:
            try:
                self._need = next(self._steps[0])
            except StopIteration as done:  # a prompt with nothing to run
                self._outputs.append(done.value)
                self._steps.popleft()
        return self._need

    def close(self) -> None:
        """Closes the generators of the prompts not done (freeing their sequences)."""
        while self._steps:
            self._steps.popleft().close()

    def resolve(self) -> None:
        self._settle(self._outputs, None)

    def fail(self, error: BaseException) -> None:
        self.close()
        self._settle(None, error)

    def _settle(self, result: Any, error: BaseException | None) -> None:
        def settle() -> None:
            if self.future.done():  # the caller was cancelled
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's event loop is closed: nobody waits
            pass

"""Jobs for ``AsyncLLM``'s step loop: work on the model outside the scheduler, run one piece at a time
between two engine steps, so running requests keep decoding beside it. An ``embed`` call's prompts
are prefills (``LLM._embedding_steps``) in chunks of ``max_num_batched_tokens`` tokens; a
``beam_search`` call on the native runner is its prompts' chunked prefills, then one batched decode
of every live beam per piece (``beam_search.native_beam_steps``). A job owns its generators (each
yields the KV blocks its next piece takes, and returns its result) and the caller's asyncio future;
only the step loop advances it, under the engine lock.

A piece runs only when the KV cache can give it its blocks (free or evictable), as the scheduler's
own requests finish or are preempted and other jobs end; once nothing else can free any (no request
runs, and every other job waited its last turn), a piece the cache cannot hold fails its job with a
``ValueError`` (so of two jobs that each hold what the other needs, one fails and the other goes
on). Closing a job (cancelled, failed, the engine shut down) closes its generators, which frees the
sequences they hold."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Generator, Sequence
from typing import Any

Steps = Generator[int, None, Any]


class LoopJob:
    """One call's work: its generators in order, their results so far, and the future its caller awaits
    (the list of results). ``what`` names the work in errors. ``cancelled`` is set from the caller's
    thread; the loop drops the job when it sees it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, steps: Sequence[Steps], what: str) -> None:
        self.loop = loop
        self.future: asyncio.Future[list[Any]] = loop.create_future()
        self._what = what
        self._steps = deque(steps)
        self._outputs: list[Any] = []
        self._need: int | None = None  # blocks the next piece takes, once its generator said so
        self.cancelled = False
        self.pieces_run = 0

    def advance(self, available_blocks: int, nothing_frees_blocks: bool) -> bool:
        """Runs the next piece if the cache has its blocks (else waits for another call); True once
        every generator is done. ``nothing_frees_blocks``: no request runs and no other job will end
        (waiting requests hold none), so a piece that does not fit never will (a ``ValueError``)."""
        need = self._next_need()
        if need is None:
            return True
        if need > available_blocks:
            if nothing_frees_blocks:
                raise ValueError(
                    f"the KV cache cannot hold this {self._what}: its next step needs {need} more blocks, "
                    f"{available_blocks} are free; raise kv_cache_blocks or shorten the prompt"
                )
            return False
        steps = self._steps[0]
        self.pieces_run += 1
        try:
            self._need = steps.send(None)
        except StopIteration as done:
            self._outputs.append(done.value)
            self._steps.popleft()
            self._need = None
        return not self._steps

    def _next_need(self) -> int | None:
        """The blocks the next piece takes (starting the next generator if need be), or None when
        every generator is done."""
        while self._need is None and self._steps:
            try:
                self._need = next(self._steps[0])
            except StopIteration as done:  # a generator with nothing to run
                self._outputs.append(done.value)
                self._steps.popleft()
        return self._need

    def close(self) -> None:
        """Closes the generators not done (freeing their sequences)."""
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

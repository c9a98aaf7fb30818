"""A request's beam search (vLLM's ``use_beam_search``), read as the samples of ``generation.Samples``.

Each prompt's ``n`` best beams are its ``n`` choices (choice ``k * n + i`` is beam ``i`` of prompt
``k``, best first). An engine with its own ``beam_search`` (``AsyncLLM``: forked KV sequences on the
native runner) runs it, ``start`` letting it run to its first wait; elsewhere (a remote engine) the
search's steps are one-token requests (``AsyncEngineBeams``), ``start`` running the first. Either way
a full queue or a dead engine is an error before any response. Every choice's output comes once, when
the search ends (a stream carries each beam's whole text in one chunk, as vLLM's does); while waiting
a stream gets keep-alives. ``aclose`` cancels the search, which frees what it holds."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from oxibonsai.async_beam_search import AsyncEngineBeams
from oxibonsai.async_llm import EngineDeadError
from oxibonsai.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from oxibonsai.outputs import CompletionOutput, RequestMetrics, RequestOutput
from oxibonsai.server.errors import APIError
from oxibonsai.server.generation import Prompt


class BeamSamples:
    def __init__(
        self, prompts: Sequence[Prompt], width: int, task: asyncio.Future[list[BeamSearchOutput]]
    ) -> None:
        self._prompts = list(prompts)
        self._width = width
        self._task = task
        self._arrival = time.perf_counter()

    @classmethod
    async def start(
        cls, engine: Any, prompts: Sequence[Prompt], params: BeamSearchParams, *, priority: int = 0
    ) -> BeamSamples:
        own = getattr(engine, "beam_search", None)
        if own is not None:
            if not engine.is_running:
                raise _unavailable()
            task = asyncio.ensure_future(own([p.engine_prompt() for p in prompts], params, priority=priority))
            await asyncio.sleep(0)  # its admission (a full queue, a dead engine) runs to its first wait
            if task.done():
                _admission_error(task)
            return cls(prompts, params.beam_width, task)
        tokenizer = engine.tokenizer
        ids = [p.token_ids for p in prompts]
        state = BeamSearch(ids, params, set(tokenizer.stop_token_ids), tokenizer.decode)
        salts = [p.cache_salt for p in prompts]
        beams = AsyncEngineBeams(
            engine.generate, state, salts, request_id=uuid.uuid4().hex, priority=priority
        )
        try:
            await beams.step()
        except EngineDeadError as error:
            raise _unavailable() from error

        async def rest() -> list[BeamSearchOutput]:
            await beams.run()
            return state.outputs()

        return cls(prompts, params.beam_width, asyncio.ensure_future(rest()))

    async def events(self, idle_s: float | None = None) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """Every choice's final output once the search ends; a ``None`` each ``idle_s`` before that."""
        try:
            while not self._task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(self._task), idle_s)
                except asyncio.TimeoutError:
                    yield None
            for item in self._outputs(self._task.result()):
                yield item
        finally:
            await self.aclose()

    def _outputs(self, results: list[BeamSearchOutput]) -> list[tuple[int, RequestOutput]]:
        """(choice index, output) of every beam: beam ``i`` of prompt ``k`` is choice ``k * n + i``."""
        finished = time.perf_counter()
        n = self._width
        return [
            (k * n + i, self._output(prompt, i, beam, finished))
            for k, (prompt, result) in enumerate(zip(self._prompts, results, strict=True))
            for i, beam in enumerate(result.sequences)
        ]

    def _output(self, prompt: Prompt, index: int, beam: BeamSearchSequence, finished: float) -> RequestOutput:
        generated = beam.tokens[len(prompt.token_ids) :]
        metrics = RequestMetrics(
            self._arrival, finished_time=finished, num_prompt_tokens=len(prompt.token_ids)
        )
        metrics.num_generated_tokens = len(generated)
        completion = CompletionOutput(
            index=index,
            text=beam.text or "",
            token_ids=generated,
            cumulative_logprob=beam.cum_logprob,
            finish_reason=beam.finish_reason,
        )
        return RequestOutput(uuid.uuid4().hex, prompt.text, prompt.token_ids, [completion], True, metrics)

    async def final_outputs(self) -> list[RequestOutput]:
        outputs = []
        async for event in self.events():
            assert event is not None
            outputs.append(event[1])
        return outputs

    async def aclose(self) -> None:
        """Cancels the search if it still runs (its requests are aborted)."""
        if not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _unavailable() -> APIError:
    return APIError(503, "The engine is not running (it failed or is shutting down).")


def _admission_error(task: asyncio.Future[Any]) -> None:
    """Raises what ended a search at its admission (a dead engine as a 503)."""
    try:
        task.result()
    except EngineDeadError as error:
        raise _unavailable() from error

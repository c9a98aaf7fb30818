"""A request's beam search (vLLM's ``use_beam_search``), read as the samples of ``generation.Samples``.

Each prompt's ``n`` best beams are its ``n`` choices (choice ``k * n + i`` is beam ``i`` of prompt
``k``, best first). ``start`` runs the search's first step, so a full queue or a dead engine is an
error before any response is sent; the rest runs in a task. Every choice's output comes once, when the
search ends (a stream carries each beam's whole text in one chunk, as vLLM's does); while waiting a
stream gets keep-alives. ``aclose`` cancels the search, which aborts its running requests."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from oxibonsai.async_beam_search import AsyncEngineBeams
from oxibonsai.async_llm import EngineDeadError
from oxibonsai.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence
from oxibonsai.outputs import CompletionOutput, RequestMetrics, RequestOutput
from oxibonsai.server.errors import APIError
from oxibonsai.server.generation import Prompt


class BeamSamples:
    def __init__(self, prompts: Sequence[Prompt], search: BeamSearch, task: asyncio.Future[None]) -> None:
        self._prompts = list(prompts)
        self._search = search
        self._task = task
        self._arrival = time.perf_counter()

    @classmethod
    async def start(
        cls, engine: Any, prompts: Sequence[Prompt], params: BeamSearchParams, *, priority: int = 0
    ) -> BeamSamples:
        tokenizer = engine.tokenizer
        ids = [p.token_ids for p in prompts]
        search = BeamSearch(ids, params, set(tokenizer.stop_token_ids), tokenizer.decode)
        salts = [p.cache_salt for p in prompts]
        rid = uuid.uuid4().hex
        beams = AsyncEngineBeams(engine.generate, search, salts, request_id=rid, priority=priority)
        try:
            await beams.step()
        except EngineDeadError as error:
            raise APIError(503, "The engine is not running (it failed or is shutting down).") from error
        return cls(prompts, search, asyncio.ensure_future(beams.run()))

    async def events(self, idle_s: float | None = None) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """Every choice's final output once the search ends; a ``None`` each ``idle_s`` before that."""
        try:
            while not self._task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(self._task), idle_s)
                except asyncio.TimeoutError:
                    yield None
            self._task.result()
            for item in self._outputs():
                yield item
        finally:
            await self.aclose()

    def _outputs(self) -> list[tuple[int, RequestOutput]]:
        """(choice index, output) of every beam: beam ``i`` of prompt ``k`` is choice ``k * n + i``."""
        finished = time.perf_counter()
        n = self._search.width
        return [
            (k * n + i, self._output(prompt, i, beam, finished))
            for k, (prompt, result) in enumerate(zip(self._prompts, self._search.outputs(), strict=True))
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

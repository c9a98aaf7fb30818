"""Beam search on an async engine (``AsyncLLM.beam_search``, and the server's ``use_beam_search``).

The search is ``oxibonsai.beam_search``'s; each step's candidates come from one-token requests of the
engine, one per live beam, submitted together so the scheduler batches them with everything else it
runs (vLLM's server runs beam search the same way). The prefix cache holds each beam's full blocks,
so a step recomputes at most a block and a token per beam. A step's requests take the search's
request id with the step and beam appended. If one fails (``QueueFull``, an engine that died) the
others are aborted and the error is raised; cancelling the search aborts its running requests.

``generate`` is the engine's: ``AsyncLLM.generate`` or a remote engine's, anything whose stream is
an async iterator of ``RequestOutput`` with ``aclose``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from oxibonsai.beam_search import BeamSearch, beam_prompt, candidates_of, one_token_params
from oxibonsai.outputs import RequestOutput


class AsyncEngineBeams:
    """The candidates of each step of ``search`` as concurrent one-token requests of ``generate``;
    ``salts`` is each prompt's cache salt (or None)."""

    def __init__(
        self,
        generate: Callable[..., Any],
        search: BeamSearch,
        salts: Sequence[str | None],
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> None:
        self._generate = generate
        self._search = search
        self._salts = list(salts)
        self._one_token = one_token_params(search.width)
        self._request_id = uuid.uuid4().hex if request_id is None else request_id
        self._priority = priority
        self._steps = 0

    async def step(self) -> None:
        """One step of the search: every live beam's request submitted before any is read."""
        streams = []
        try:
            for i, (beam, k) in enumerate(zip(self._search.beams, self._search.owners, strict=True)):
                prompt = beam_prompt(beam.tokens, self._salts[k])
                rid = f"{self._request_id}-{self._steps}-{i}"
                streams.append(
                    self._generate(prompt, self._one_token, request_id=rid, priority=self._priority)
                )
                accepted = getattr(streams[-1], "accepted", None)
                if accepted is not None:  # a remote engine answers admission asynchronously
                    await accepted()
            finals = await _all_finals(streams)
        finally:
            for stream in streams:
                await stream.aclose()
        self._steps += 1
        self._search.step([candidates_of(out) for out in finals])

    async def run(self) -> None:
        """Steps until the search is finished."""
        while not self._search.finished:
            await self.step()


async def _all_finals(streams: list[Any]) -> list[RequestOutput]:
    """Each stream's last output; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(_last(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _last(stream: Any) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None
    return last

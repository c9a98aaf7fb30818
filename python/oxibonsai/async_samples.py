"""``SampleGroupStream``: ``AsyncLLM.generate`` with ``SamplingParams(n > 1)``, one stream of ``n``
samples of one prompt, as vLLM streams them: each item is one ``RequestOutput`` holding every sample's
completion so far (``outputs[i].index == i``), the last one with every sample finished.

Sample 0 is submitted at once (its submission errors reach the caller of ``generate``); the others
start once it has sampled its first token, when the prompt's full blocks are in the prefix cache, so
they compute only what is left (as ``LLM.generate`` and the server do). A later sample that cannot be
submitted (a full queue) ends the stream with that error and aborts the rest; so does leaving the
stream early. Sample ``i`` runs as request ``"{request_id}-{i}"`` with ``params.for_sample(i)``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from oxibonsai.outputs import CompletionOutput, RequestOutput
from oxibonsai.sampling_params import SamplingParams

_END = object()  # a sample's stream is over


class SampleGroupStream:
    """The async iterator of ``n`` samples (the module doc); ``aclose()`` aborts the unfinished ones."""

    def __init__(
        self, submit: Callable[[int], Any], params: SamplingParams, first: Any, request_id: str
    ) -> None:
        self.request_id = request_id
        self._submit = submit  # sample index -> its RequestStream
        self._n = params.n
        self._streams = [first]
        self._latest: list[RequestOutput | None] = [None] * self._n
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._readers: list[asyncio.Task[None]] = []
        self._done = False

    def __aiter__(self) -> SampleGroupStream:
        return self

    @property
    def done(self) -> bool:
        return self._done

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            if not self._readers:
                self._start_reading(0)
            index, item = await self._next_item()
            if index == 0 and self._latest[0] is None:
                self._start_rest()
        except BaseException:
            await self.aclose()
            raise
        assert isinstance(item, RequestOutput)
        self._latest[index] = item
        merged = self._merged()
        self._done = merged.finished
        return merged

    async def _next_item(self) -> tuple[int, object]:
        """The next output of any sample; raises a sample's error."""
        while True:
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is not _END:
                return index, item

    def _start_reading(self, index: int) -> None:
        self._readers.append(asyncio.ensure_future(self._read(index, self._streams[index])))

    async def _read(self, index: int, stream: Any) -> None:
        try:
            async for out in stream:
                await self._queue.put((index, out))
        except Exception as error:  # handed to the consumer (a cancellation is not)
            await self._queue.put((index, error))
            return
        await self._queue.put((index, _END))

    def _start_rest(self) -> None:
        """Submits samples 1..n-1 (sample 0's prompt is cached now); a failure ends the group."""
        for i in range(1, self._n):
            self._streams.append(self._submit(i))
            self._start_reading(i)

    def _merged(self) -> RequestOutput:
        """Every sample's latest completion, on sample 0's output (it is always the first to arrive)."""
        first = self._latest[0]
        assert first is not None, "sample 0 arrives first: the others start after it"
        completions = [
            dataclasses.replace(o.outputs[0], index=i) if o is not None else _empty_completion(i)
            for i, o in enumerate(self._latest)
        ]
        finished = all(o is not None and o.finished for o in self._latest)
        return dataclasses.replace(first, outputs=completions, finished=finished, request_id=self.request_id)

    async def aclose(self) -> None:
        """Stops listening; aborts every sample that has not finished."""
        self._done = True
        for task in self._readers:
            task.cancel()
        for stream in self._streams:
            await stream.aclose()


def _empty_completion(index: int) -> CompletionOutput:
    return CompletionOutput(index=index, text="", token_ids=[], cumulative_logprob=None, logprobs=None)

"""The engine side of a request: output budgets, and ``n`` samples of one prompt as one merged stream.

``output_budget`` applies vLLM's rule (the prompt is checked before the output budget is derived, with
vLLM's "maximum context length" wording). ``Samples`` submits the ``n`` samples of each prompt to the
``AsyncLLM``: with ``n > 1`` it submits the first, waits until its prompt is computed (its first output),
then submits the others, which find the prompt's full blocks in the prefix cache instead of computing
them again. Every submission error (``QueueFull``, ``ValueError``) surfaces from ``start`` before a
response is sent, after aborting what was already submitted. ``events`` merges the samples' outputs in
arrival order; ``aclose`` aborts whatever is still running, so a client that leaves frees its blocks."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from oxibonsai.async_llm import AsyncLLM, EngineDeadError, RequestStream
from oxibonsai.outputs import RequestOutput
from oxibonsai.sampling_params import SamplingParams, truncated
from oxibonsai.server.errors import APIError


def context_length_error(max_model_len: int, prompt_len: int, max_tokens: int) -> APIError:
    total = prompt_len + max_tokens
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{max_tokens} output tokens and your prompt contains {prompt_len} input tokens, for a total "
        f"of {total} tokens ({prompt_len} + {max_tokens} = {total} > {max_model_len}). Please reduce "
        "the length of the input prompt or the number of requested output tokens.",
        param="input_tokens",
    )


def output_budget(max_model_len: int, prompt_len: int, requested: int | None) -> int:
    """The most tokens this request may generate; a 400 when prompt plus request exceed the context.
    ``requested`` None means the rest of the context (at least one token must fit)."""
    if prompt_len == 0:
        raise APIError(400, "The prompt is empty: at least one token is needed.", param="prompt")
    wanted = 1 if requested is None else requested
    if prompt_len + wanted > max_model_len:
        raise context_length_error(max_model_len, prompt_len, wanted)
    return max_model_len - prompt_len if requested is None else requested


@dataclass(frozen=True)
class Prompt:
    """A prompt ready for the engine: its text (if any), token ids and cache salt."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None

    def truncated(self, keep: int | None, max_model_len: int) -> Prompt:
        """The prompt cut to its last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``; -1: the
        context's length); a cut prompt's text is left out (the tokens are the prompt)."""
        ids = truncated(self.token_ids, keep, max_model_len)
        return self if ids is self.token_ids else Prompt(None, ids, self.cache_salt)

    def engine_prompt(self) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt": self.text, "prompt_token_ids": self.token_ids}
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt


class Samples:
    """Every sample of a request (``n`` per prompt; choice ``k * n + i`` is sample ``i`` of prompt ``k``),
    started together and read as one stream of ``(choice index, output)``."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine
        self._request_id = uuid.uuid4().hex
        self._streams: dict[int, RequestStream] = {}
        self._early: list[tuple[int, RequestOutput]] = []  # read while starting the later samples

    @classmethod
    async def start(
        cls, engine: AsyncLLM, jobs: Sequence[tuple[Prompt, SamplingParams]], n: int, *, priority: int = 0
    ) -> Samples:
        """Submits ``n`` samples of every ``(prompt, params)``."""
        samples = cls(engine)
        prepare = getattr(engine, "prepare_structured_output", None)  # a remote engine compiles there
        if prepare is not None:
            for _, params in jobs:  # a grammar compiles off the event loop
                await asyncio.to_thread(prepare, params)
        try:
            for k, (prompt, params) in enumerate(jobs):
                await samples._start_prompt(prompt, params, n, k * n, priority)
        except BaseException:
            await samples.aclose()
            raise
        return samples

    async def _start_prompt(
        self, prompt: Prompt, params: SamplingParams, n: int, base: int, priority: int
    ) -> None:
        first = await self._submit(prompt, params, base, 0, priority)
        if n == 1:
            return
        self._early.append((base, await first.__anext__()))  # the prompt's full blocks are cached now
        for i in range(1, n):
            await self._submit(prompt, params, base + i, i, priority)

    async def _submit(
        self, prompt: Prompt, params: SamplingParams, choice: int, sample: int, priority: int
    ) -> RequestStream:
        try:
            stream = self._engine.generate(
                prompt.engine_prompt(),
                params.for_sample(sample),
                request_id=f"{self._request_id}-{choice}",
                priority=priority,
            )
            self._streams[choice] = stream
            accepted = getattr(stream, "accepted", None)
            if accepted is not None:  # a remote engine answers admission asynchronously (scale_out)
                await accepted()
        except EngineDeadError as error:  # refused at admission: unavailable, not a failure mid-request
            raise APIError(503, "The engine is not running (it failed or is shutting down).") from error
        return stream

    async def events(self, idle_s: float | None = None) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """Every output of every sample as it arrives; ends when all have finished. With ``idle_s``, a
        ``None`` whenever that long passes without an output (a stream's keep-alive). Leaving early (or
        an error) aborts the samples still running."""
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in self._streams.items() if not s.done]
        try:
            early, self._early = self._early, []
            for item in early:
                yield item
            remaining = len(pumps)
            while remaining:
                try:
                    index, out = await asyncio.wait_for(queue.get(), idle_s)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if out is None:
                    remaining -= 1
                elif isinstance(out, BaseException):
                    raise out
                else:
                    yield index, out
        finally:
            for pump in pumps:
                pump.cancel()
            await self.aclose()

    async def final_outputs(self) -> list[RequestOutput]:
        """Reads every sample to its end; the last output of each, by choice index."""
        last: dict[int, RequestOutput] = {}
        async for event in self.events():
            assert event is not None  # no keep-alive without idle_s
            index, out = event
            last[index] = out
        return [last[i] for i in sorted(last)]

    async def aclose(self) -> None:
        """Aborts every sample that has not finished (frees their KV blocks)."""
        for stream in self._streams.values():
            await stream.aclose()


async def _pump(
    index: int, stream: RequestStream, queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]]
) -> None:
    try:
        async for out in stream:
            queue.put_nowait((index, out))
    except asyncio.CancelledError:
        raise
    except BaseException as error:  # handed to the reader, which raises it
        queue.put_nowait((index, error))
        return
    queue.put_nowait((index, None))

"""``/v1/completions``: prompts (strings or token ids, one or many) to engine requests, and engine outputs
to a ``text_completion`` response or its SSE chunks. Choice ``k * n + i`` is sample ``i`` of prompt ``k``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.outputs import RequestOutput
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.generation import Prompt, Samples, output_budget
from oxibonsai.server.openai_format import (
    DONE_EVENT,
    KEEPALIVE_EVENT,
    UsageCounter,
    completion_logprobs,
    created,
    full_response,
    response_id,
    sse,
)
from oxibonsai.server.protocol import CompletionRequest
from oxibonsai.server.streaming import ChoiceCursor, error_event


class CompletionServing:
    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self._engine = engine
        self._config = config

    async def start(self, req: CompletionRequest) -> Samples:
        """Tokenizes (in a worker thread), checks lengths and submits every sample; raises before any
        response is sent."""
        prompts = await asyncio.to_thread(self._prompts, req)
        jobs = []
        for prompt in prompts:
            budget = output_budget(self._engine.max_model_len, len(prompt.token_ids), req.max_tokens)
            jobs.append((prompt, req.sampling_params(budget, req.logprobs)))
        return await Samples.start(self._engine, jobs, req.n, priority=req.priority)

    def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        tokenizer = self._engine.tokenizer
        out = []
        for p in req.prompts():
            if isinstance(p, str):
                out.append(Prompt(p, tokenizer.encode(p), req.cache_salt))
            else:
                out.append(Prompt(None, p, req.cache_salt))
        return out

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self._engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _choice(self, req: CompletionRequest, index: int, out: RequestOutput) -> dict[str, Any]:
        completion = out.outputs[0]
        prefix = self._prompt_text(out) if req.echo else ""
        logprobs = None
        if req.logprobs is not None and completion.logprobs is not None:
            logprobs = completion_logprobs(
                self._engine.tokenizer, completion.token_ids, completion.logprobs, req.logprobs, len(prefix)
            )
        return {
            "index": index,
            "text": prefix + completion.text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }

    async def full_response(self, req: CompletionRequest, samples: Samples) -> dict[str, Any]:
        finals = await samples.final_outputs()
        model = self._config.served_model_name
        return full_response(
            "cmpl", "text_completion", model, req.n, finals, lambda i, out: self._choice(req, i, out)
        )

    async def stream(self, req: CompletionRequest, samples: Samples) -> AsyncIterator[bytes]:
        """SSE chunks: text deltas per choice (the prompt first with ``echo``), ``finish_reason`` on a
        choice's last chunk, a usage chunk when asked, then ``[DONE]``; an engine error after the
        header becomes one error event."""
        base = {"id": response_id("cmpl"), "object": "text_completion", "created": created()}
        base["model"] = self._config.served_model_name
        counter = UsageCounter(req.n)
        cursors: dict[int, ChoiceCursor] = {}
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        try:
            async for event in samples.events(self._config.sse_keepalive_s or None):
                if event is None:
                    yield KEEPALIVE_EVENT
                    continue
                index, out = event
                counter.update(index, out)
                cursor = cursors.setdefault(index, ChoiceCursor())
                choice = self._delta_choice(req, index, out, cursor)
                if choice is not None:
                    chunk = {**base, "choices": [choice]}
                    if continuous:
                        chunk["usage"] = counter.usage()
                    yield sse(chunk)
            if req.include_usage(self._config.force_include_usage):
                yield sse({**base, "choices": [], "usage": counter.usage()})
        except Exception as error:
            yield error_event(error)
        yield DONE_EVENT

    def _delta_choice(
        self, req: CompletionRequest, index: int, out: RequestOutput, cursor: ChoiceCursor
    ) -> dict[str, Any] | None:
        completion = out.outputs[0]
        prefix = self._prompt_text(out) if req.echo and not cursor.started else ""
        text = prefix + cursor.new_text(completion.text)
        tokens, entries = cursor.new_tokens(completion.token_ids, completion.logprobs)
        if not text and not completion.finish_reason and not (tokens and req.logprobs is not None):
            return None
        cursor.started = True
        logprobs = None
        if req.logprobs is not None and entries is not None:
            logprobs = completion_logprobs(
                self._engine.tokenizer, tokens, entries, req.logprobs, cursor.take_offset(text)
            )
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }

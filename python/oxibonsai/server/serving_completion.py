"""``/v1/completions``: prompts (strings or token ids, one or many) to engine requests, and engine outputs
to a ``text_completion`` response or its SSE chunks. Choice ``k * n + i`` is sample ``i`` of prompt ``k``.
With ``echo`` and ``logprobs`` the prompt's tokens lead the logprobs (the first one null), as
lm-eval-harness's loglikelihood requests read them; ``max_tokens`` 0 with ``echo`` returns the prompt
alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.outputs import RequestOutput
from oxibonsai.server.beam_samples import BeamSamples
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.errors import APIError
from oxibonsai.server.generation import Prompt, Samples, output_budget
from oxibonsai.server.openai_format import (
    DONE_EVENT,
    KEEPALIVE_EVENT,
    UsageCounter,
    completion_logprobs,
    created,
    full_response,
    joined_logprobs,
    prompt_logprobs_json,
    response_id,
    sse,
)
from oxibonsai.server.protocol import CompletionRequest
from oxibonsai.server.streaming import ChoiceCursor, error_event


class CompletionServing:
    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self._engine = engine
        self._config = config

    async def start(self, req: CompletionRequest) -> Samples | BeamSamples:
        """Tokenizes (in a worker thread), checks lengths and submits every sample; raises before any
        response is sent."""
        if req.max_tokens == 0 and not req.echo:
            message = "max_tokens must be >= 1 (0 only with echo: the prompt alone)"
            raise APIError(400, message, param="max_tokens")
        prompts = await asyncio.to_thread(self._prompts, req)
        jobs = []
        for prompt in prompts:
            prompt = prompt.truncated(req.truncate_prompt_tokens, self._engine.max_model_len)
            requested = 1 if req.echo_only else req.max_tokens
            budget = output_budget(self._engine.max_model_len, len(prompt.token_ids), requested)
            jobs.append((prompt, budget))
        if req.use_beam_search:
            beams = req.beam_search_params(min(budget for _, budget in jobs))
            return await BeamSamples.start(self._engine, [p for p, _ in jobs], beams, priority=req.priority)
        defaults = self._engine.default_sampling_fields
        params = [
            (p, req.sampling_params(budget, req.logprobs, req.scored_prompt_logprobs, defaults))
            for p, budget in jobs
        ]
        return await Samples.start(self._engine, params, req.n, priority=req.priority)

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

    def _logprobs(
        self,
        req: CompletionRequest,
        out: RequestOutput | None,
        token_ids: list[int],
        entries: Any,
        offset: int,
    ) -> dict[str, Any] | None:
        """The legacy logprobs of ``token_ids`` (starting at text ``offset``), after those of ``out``'s
        echoed prompt (its text at 0) unless ``out`` is None, or None without ``logprobs``."""
        if req.logprobs is None or entries is None:
            return None
        tokenizer = self._engine.tokenizer
        generated = completion_logprobs(tokenizer, token_ids, entries, req.logprobs, offset)
        if out is None or out.prompt_logprobs is None:
            return generated
        prompt = completion_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs, req.logprobs, 0)
        return joined_logprobs(prompt, generated)

    def _choice(self, req: CompletionRequest, index: int, out: RequestOutput) -> dict[str, Any]:
        completion = out.outputs[0]
        prefix = self._prompt_text(out) if req.echo else ""
        text, token_ids, entries = _generated(req, out)
        choice = {
            "index": index,
            "text": prefix + text,
            "logprobs": self._logprobs(req, out if req.echo else None, token_ids, entries, len(prefix)),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(
                out.prompt_token_ids, out.prompt_logprobs, req.prompt_logprobs
            )
        return choice

    async def full_response(self, req: CompletionRequest, samples: Samples | BeamSamples) -> dict[str, Any]:
        finals = await samples.final_outputs()
        model = self._config.served_model_name
        return full_response(
            "cmpl", "text_completion", model, req.n, finals, lambda i, out: self._choice(req, i, out)
        )

    async def stream(self, req: CompletionRequest, samples: Samples | BeamSamples) -> AsyncIterator[bytes]:
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
        first = not cursor.started
        prefix = self._prompt_text(out) if req.echo and first else ""
        text, token_ids, entries = _generated(req, out)
        text = prefix + cursor.new_text(text)
        tokens, entries = cursor.new_tokens(token_ids, entries)
        if not text and not completion.finish_reason and not (tokens and req.logprobs is not None):
            return None
        cursor.started = True
        offset = cursor.take_offset(text) + len(prefix)
        # The prompt's logprobs come with its text, in the first chunk.
        logprobs = self._logprobs(req, out if prefix else None, tokens, entries, offset)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }


def _generated(req: CompletionRequest, out: RequestOutput) -> tuple[str, list[int], Any]:
    """The completion's text, token ids and logprob entries as the response shows them: none with
    ``echo_only`` (the token generated for it is left out)."""
    completion = out.outputs[0]
    if req.echo_only:
        return "", [], [] if completion.logprobs is not None else None
    return completion.text, completion.token_ids, completion.logprobs

"""``/v1/chat/completions``: messages through the model's chat template (tools included) to an engine
request, and engine outputs to a ``chat.completion`` response or its SSE chunks. With ``tools``, the
Qwen3/Hermes ``<tool_call>`` blocks in the output become ``tool_calls`` (``finish_reason:
"tool_calls"``, or ``"stop"`` where ``tool_choice`` named the function), in streams too; the text
around them stays ``content``; with ``parallel_tool_calls: false`` the engine stops at the first
call's ``</tool_call>``, which is put back for the parser. With a reasoning parser, the output's
``<think>`` block (or the block the prompt opened) becomes ``reasoning`` and ``reasoning_content``
first, and tool calls are looked for in the rest. vLLM's ``prompt_logprobs`` (not streamed) come at
the response's top level."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.outputs import RequestOutput
from oxibonsai.server.beam_samples import BeamSamples
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.generation import Prompt, Samples, output_budget
from oxibonsai.server.openai_format import (
    DONE_EVENT,
    KEEPALIVE_EVENT,
    UsageCounter,
    chat_logprobs,
    created,
    full_response,
    prompt_logprobs_json,
    response_id,
    sse,
)
from oxibonsai.server.protocol import ChatCompletionRequest
from oxibonsai.server.reasoning import StreamingReasoningParser, prompt_opens_reasoning, split_reasoning
from oxibonsai.server.streaming import ChoiceCursor, error_event
from oxibonsai.server.tool_parser import CLOSE_TAG, StreamingToolParser, ToolCall, parse_tool_calls

# Template variables a request's chat_template_kwargs may not override.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "tokenize", "continue_final_message"}
)


def render_chat(engine: AsyncLLM, req: ChatCompletionRequest) -> Prompt:
    """The request's conversation through the model's template, tokenized (special tokens in the text
    map to their ids). Runs in a worker thread: templates and tokenizing can take a while."""
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    text = engine.tokenizer.apply_chat_template(
        req.template_messages(),
        add_generation_prompt=req.add_generation_prompt,
        tools=req.template_tools(),
        continue_final_message=req.continue_final_message,
        **kwargs,
    )
    return Prompt(text, engine.tokenizer.encode(text, add_special_tokens=False), req.cache_salt)


def _tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        out = {"index": index, **out}
    return out


def _finish(req: ChatCompletionRequest, reason: str | None, made_tool_calls: bool) -> str | None:
    """``"tool_calls"`` for an output that stopped after making calls, unless the request named the
    function to call (OpenAI's and vLLM's ``"stop"`` then)."""
    return "tool_calls" if made_tool_calls and reason == "stop" and not req.names_a_function() else reason


def _closing_tag(req: ChatCompletionRequest, stop_reason: int | str | None) -> str:
    """The ``</tool_call>`` an output that stopped at its first call lacks (the engine keeps a stop
    string out of the text), so the call parses; "" for any other output."""
    ended = req.ended_at_first_call(stop_reason) and not req.include_stop_str_in_output
    return CLOSE_TAG if ended else ""


def _stop_reason(req: ChatCompletionRequest, stop_reason: int | str | None) -> int | str | None:
    """The output's ``stop_reason``; None where it is the server's own stop at the first call."""
    return None if req.ended_at_first_call(stop_reason) else stop_reason


class ChatServing:
    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self._engine = engine
        self._config = config

    async def start(self, req: ChatCompletionRequest) -> Samples | BeamSamples:
        prompt = await asyncio.to_thread(render_chat, self._engine, req)
        prompt = prompt.truncated(req.truncate_prompt_tokens, self._engine.max_model_len)
        budget = output_budget(self._engine.max_model_len, len(prompt.token_ids), req.requested_max_tokens())
        if req.use_beam_search:
            beams = req.beam_search_params(budget)
            return await BeamSamples.start(self._engine, [prompt], beams, priority=req.priority)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        defaults = self._engine.default_sampling_fields
        params = req.sampling_params(budget, logprobs, req.prompt_logprobs, defaults)
        return await Samples.start(self._engine, [(prompt, params)], req.n, priority=req.priority)

    def _logprobs(self, req: ChatCompletionRequest, tokens: list[int], entries: Any) -> dict[str, Any] | None:
        if not req.logprobs or entries is None:
            return None
        return chat_logprobs(self._engine.tokenizer, tokens, entries, req.top_logprobs or 0)

    def choice(self, req: ChatCompletionRequest, index: int, out: RequestOutput) -> dict[str, Any]:
        completion = out.outputs[0]
        reasoning, content = None, completion.text + _closing_tag(req, completion.stop_reason)
        parser = self._config.reasoning_parser
        if parser is not None:
            reasoning, content = split_reasoning(content, parser, prompt_opens_reasoning(out.prompt, parser))
        calls: list[ToolCall] = []
        text: str | None = None if reasoning is not None and not content else content
        if req.parses_tools():
            text, calls = parse_tool_calls(content)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [_tool_call_json(c) for c in calls]
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(req, completion.token_ids, completion.logprobs),
            "finish_reason": _finish(req, completion.finish_reason, bool(calls)),
            "stop_reason": _stop_reason(req, completion.stop_reason),
        }

    async def full_response(
        self, req: ChatCompletionRequest, samples: Samples | BeamSamples
    ) -> dict[str, Any]:
        finals = await samples.final_outputs()
        model = self._config.served_model_name
        response = full_response(
            "chatcmpl", "chat.completion", model, req.n, finals, lambda i, out: self.choice(req, i, out)
        )
        if req.prompt_logprobs is not None:  # one prompt for every choice: vLLM's top-level field
            response["prompt_logprobs"] = prompt_logprobs_json(
                finals[0].prompt_token_ids, finals[0].prompt_logprobs, req.prompt_logprobs
            )
        return response

    async def stream(
        self, req: ChatCompletionRequest, samples: Samples | BeamSamples
    ) -> AsyncIterator[bytes]:
        """SSE chunks: each choice's first chunk carries the role, then content and tool-call deltas,
        ``finish_reason`` on its last; a usage chunk when asked; ``[DONE]``."""
        stream = ChatStream(self, req)
        try:
            for i in range(req.n):
                yield sse(stream.chunk({"index": i, "delta": {"role": "assistant", "content": ""}}))
            async for event in samples.events(self._config.sse_keepalive_s or None):
                if event is None:
                    yield KEEPALIVE_EVENT
                    continue
                for choice in stream.deltas(*event):
                    yield sse(stream.chunk(choice))
            if req.include_usage(self._config.force_include_usage):
                yield sse(stream.chunk(None, with_usage=True))
        except Exception as error:
            yield error_event(error)
        yield DONE_EVENT


class ChatStream:
    """One chat stream's state: the chunk envelope, each choice's cursor and tool parser, the usage."""

    def __init__(self, serving: ChatServing, req: ChatCompletionRequest) -> None:
        self._serving = serving
        self._req = req
        self._base = {
            "id": response_id("chatcmpl"),
            "object": "chat.completion.chunk",
            "created": created(),
            "model": serving._config.served_model_name,
        }
        self._cursors: dict[int, ChoiceCursor] = {}
        self._parsers: dict[int, StreamingToolParser] = {}
        self._reasoners: dict[int, StreamingReasoningParser] = {}
        self._calls: dict[int, int] = {}  # tool calls sent per choice
        self._usage = UsageCounter(req.n)
        opts = req.stream_options
        self._continuous = opts is not None and opts.continuous_usage_stats

    def chunk(self, choice: dict[str, Any] | None, *, with_usage: bool = False) -> dict[str, Any]:
        out = {**self._base, "choices": [] if choice is None else [choice]}
        if with_usage or (self._continuous and choice is not None):
            out["usage"] = self._usage.usage()
        return out

    def deltas(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The choice objects this output adds (none when nothing new can be sent yet)."""
        self._usage.update(index, out)
        completion = out.outputs[0]
        cursor = self._cursors.setdefault(index, ChoiceCursor())
        text = cursor.new_text(completion.text)
        tokens, entries = cursor.new_tokens(completion.token_ids, completion.logprobs)
        finished = completion.finish_reason is not None
        if finished:
            text += _closing_tag(self._req, completion.stop_reason)
        reasoning, text = self._reason(index, out.prompt, text, finished)
        content, calls = self._parse(index, text, finished)
        logprobs = self._serving._logprobs(self._req, tokens, entries)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            first = self._calls.get(index, 0)
            delta["tool_calls"] = [_tool_call_json(c, first + k) for k, c in enumerate(calls)]
            self._calls[index] = first + len(calls)
        if not delta and completion.finish_reason is None and logprobs is None:
            return []
        reason = _finish(self._req, completion.finish_reason, self._calls.get(index, 0) > 0)
        return [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]

    def _reason(self, index: int, prompt: str | None, text: str, finished: bool) -> tuple[str, str]:
        name = self._serving._config.reasoning_parser
        if name is None:
            return "", text
        parser = self._reasoners.get(index)
        if parser is None:
            parser = self._reasoners[index] = StreamingReasoningParser(
                name, prompt_opens_reasoning(prompt, name)
            )
        reasoning, content = parser.feed(text)
        if finished:
            more_reasoning, more_content = parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _parse(self, index: int, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        if not self._req.parses_tools():
            return text, []
        parser = self._parsers.setdefault(index, StreamingToolParser())
        content, calls = parser.feed(text)
        if finished:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        return content, calls

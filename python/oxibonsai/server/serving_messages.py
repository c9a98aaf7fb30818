"""``/v1/messages``: Anthropic's Messages API over the chat path. A request becomes a chat completion
request (``anthropic_protocol``), runs as one, and its output (the chat message: reasoning, content,
tool calls) becomes the message's content blocks: ``thinking``, ``text`` and one ``tool_use`` per call
(its arguments parsed back into ``input``), with Anthropic's ``stop_reason`` (``tool_use``,
``max_tokens``, ``stop_sequence`` or ``end_turn``) and usage (``cache_read_input_tokens`` from the
prefix cache). Streamed, the same blocks arrive as Anthropic's events (``message_start``, a ``ping``,
``content_block_start`` / ``_delta`` / ``_stop`` per block, ``message_delta``, ``message_stop``).
Errors use Anthropic's envelope (``anthropic_error``), in streams too (an ``error`` event)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.outputs import RequestOutput
from oxibonsai.server.anthropic_protocol import MessagesRequest
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.errors import APIError, error_from_exception
from oxibonsai.server.generation import Samples
from oxibonsai.server.openai_format import KEEPALIVE_EVENT
from oxibonsai.server.protocol import ChatCompletionRequest
from oxibonsai.server.serving_chat import ChatServing, ChatStream, render_chat

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(error: APIError) -> dict[str, Any]:
    """An error in Anthropic's envelope."""
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class MessagesServing:
    def __init__(self, engine: AsyncLLM, config: ServerConfig, chat: ChatServing) -> None:
        self._engine = engine
        self._config = config
        self._chat = chat

    async def start(self, req: MessagesRequest) -> Samples:
        chat = req.chat_request()
        samples = await self._chat.start(chat)
        req.job = chat
        return samples

    async def count_tokens(self, req: MessagesRequest) -> dict[str, Any]:
        prompt = await asyncio.to_thread(render_chat, self._engine, req.chat_request(counting=True))
        return {"input_tokens": len(prompt.token_ids)}

    async def full_response(self, req: MessagesRequest, samples: Samples) -> dict[str, Any]:
        out = (await samples.final_outputs())[0]
        message = self._chat.choice(req.job, 0, out)["message"]
        blocks = content_blocks(message)
        return {
            **self._envelope(),
            "content": blocks,
            **stop_fields(req.job, out, blocks),
            "usage": {**_input_usage(out), "output_tokens": len(out.outputs[0].token_ids)},
        }

    def _envelope(self) -> dict[str, Any]:
        return {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": self._config.served_model_name,
        }

    async def stream(self, req: MessagesRequest, samples: Samples) -> AsyncIterator[bytes]:
        blocks = _BlockEvents()
        last: RequestOutput | None = None
        try:
            chat_stream = ChatStream(self._chat, req.job)
            async for event in samples.events(self._config.sse_keepalive_s or None):
                if event is None:
                    yield KEEPALIVE_EVENT
                    continue
                if last is None:  # the prompt is known with the first output
                    start = {
                        **self._envelope(),
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                    }
                    start["usage"] = {**_input_usage(event[1]), "output_tokens": 0}
                    yield _event("message_start", {"message": start})
                    yield _event("ping", {})
                last = event[1]
                for choice in chat_stream.deltas(*event):
                    for chunk in blocks.delta(choice["delta"]):
                        yield chunk
            for chunk in blocks.finish():
                yield chunk
            assert last is not None, "a request ends with an output"
            usage = {"output_tokens": len(last.outputs[0].token_ids)}
            yield _event("message_delta", {"delta": stop_fields(req.job, last, blocks.kinds), "usage": usage})
            yield _event("message_stop", {})
        except Exception as error:
            yield _event("error", {"error": anthropic_error(error_from_exception(error))["error"]})


def _input_usage(out: RequestOutput) -> dict[str, int]:
    cached = out.num_cached_tokens
    return {
        "input_tokens": len(out.prompt_token_ids) - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_fields(chat: ChatCompletionRequest, out: RequestOutput, blocks: list[Any]) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` of a finished output (``blocks``: its content blocks, or
    their types)."""
    completion = out.outputs[0]
    kinds = [b["type"] if isinstance(b, dict) else b for b in blocks]
    stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    if "tool_use" in kinds:
        reason = "tool_use"
    elif completion.finish_reason == "length":
        reason = "max_tokens"
    elif stop is not None and stop in (chat.stop or []):
        reason = "stop_sequence"
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": stop if reason == "stop_sequence" else None}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message as content blocks: thinking, text (unless only tool calls), the calls."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning") is not None:
        blocks.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        blocks.append({"type": "text", "text": message.get("content") or ""})
    blocks.extend(_tool_use(c) for c in calls)
    return blocks


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": function["name"],
        "input": json.loads(function["arguments"]),
    }


class _BlockEvents:
    """The content-block events of one streamed message: chat deltas in, events out; ``kinds`` are the
    types of the blocks sent."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self._open: str | None = None  # "thinking" or "text", while its block takes deltas

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning"):
            out += self._text("thinking", {"type": "thinking_delta", "thinking": delta["reasoning"]})
        if delta.get("content"):
            out += self._text("text", {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            out += self.close()
            block = _tool_use(call)
            index = len(self.kinds)
            self.kinds.append("tool_use")
            arguments = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
            out += [
                _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
                _event("content_block_delta", {"index": index, "delta": arguments}),
                _event("content_block_stop", {"index": index}),
            ]
        return out

    def _text(self, kind: str, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if self._open != kind:
            out += self.close()
            start = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            out.append(_event("content_block_start", {"index": len(self.kinds), "content_block": start}))
            self.kinds.append(kind)
            self._open = kind
        out.append(_event("content_block_delta", {"index": len(self.kinds) - 1, "delta": delta}))
        return out

    def finish(self) -> list[bytes]:
        """Ends the last block; an output with no block gets an empty text block, as in full."""
        if not self.kinds:
            return self._text("text", {"type": "text_delta", "text": ""}) + self.close()
        return self.close()

    def close(self) -> list[bytes]:
        """Ends the text or thinking block being streamed, if any."""
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": len(self.kinds) - 1})]

"""``/v1/responses``: OpenAI's Responses API over the chat path. A request becomes a chat completion
request (``responses_protocol``), runs as one, and its output (the chat message: reasoning, content,
tool calls) becomes the response's output items: a ``reasoning`` item, a ``message`` with one
``output_text`` part, and one ``function_call`` item per call. Streamed, the same items arrive as the
Responses API's typed events (``response.created`` ... ``response.completed``), each with its
``sequence_number``; the final event carries the whole response.

A response whose ``store`` is true (OpenAI's default) is kept in memory (the newest
``STORED_RESPONSES``), with its conversation: ``GET /v1/responses/{id}`` returns it, ``DELETE`` drops
it, and a request naming it as ``previous_response_id`` continues that conversation (without its
``instructions``, as OpenAI does)."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.outputs import RequestOutput
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.errors import APIError
from oxibonsai.server.generation import Samples
from oxibonsai.server.openai_format import KEEPALIVE_EVENT, created, sse
from oxibonsai.server.protocol import ChatCompletionRequest
from oxibonsai.server.responses_protocol import ResponsesRequest, input_messages
from oxibonsai.server.serving_chat import ChatServing, ChatStream
from oxibonsai.server.streaming import error_event
from oxibonsai.structured_output import REASONING_TOKENS

#: How many stored responses are kept (the oldest is dropped first).
STORED_RESPONSES = 1024


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Stored:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, the instructions left out


@dataclass
class _Job:
    """One admitted request: the response's id and creation time, its chat request, its history."""

    id: str
    created_at: int
    chat: ChatCompletionRequest
    history: list[dict[str, Any]]


class ResponsesServing:
    def __init__(self, engine: AsyncLLM, config: ServerConfig, chat: ChatServing) -> None:
        self._engine = engine
        self._config = config
        self._chat = chat
        self._stored: OrderedDict[str, _Stored] = OrderedDict()

    def get(self, response_id: str) -> dict[str, Any]:
        stored = self._stored.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.body

    def delete(self, response_id: str) -> dict[str, Any]:
        if self._stored.pop(response_id, None) is None:
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def start(self, req: ResponsesRequest) -> Samples:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self._stored.get(req.previous_response_id)
            if previous is None:
                raise _not_found(req.previous_response_id, param="previous_response_id")
            history = previous.conversation
        chat = req.chat_request(history)
        samples = await self._chat.start(chat)
        req.job = _Job(_new_id("resp"), created(), chat, history)
        return samples

    async def full_response(self, req: ResponsesRequest, samples: Samples) -> dict[str, Any]:
        job = req.job
        out = (await samples.final_outputs())[0]
        choice = self._chat.choice(job.chat, 0, out)
        body = self._body(req, job, out, output_items(choice["message"], _logprobs(choice)))
        self._keep(req, job, body, choice["message"])
        return body

    async def stream(self, req: ResponsesRequest, samples: Samples) -> AsyncIterator[bytes]:
        job = req.job
        events = ResponseEvents()
        start = self._body(req, job, None, [])
        yield events.emit("response.created", response=start)
        yield events.emit("response.in_progress", response=start)
        try:
            chat_stream = ChatStream(self._chat, job.chat)
            last: RequestOutput | None = None
            async for event in samples.events(self._config.sse_keepalive_s or None):
                if event is None:
                    yield KEEPALIVE_EVENT
                    continue
                last = event[1]
                for choice in chat_stream.deltas(*event):
                    for chunk in events.delta(choice["delta"]):
                        yield chunk
            for chunk in events.close():
                yield chunk
            assert last is not None, "a request ends with an output"
            body = self._body(req, job, last, events.output)
            self._keep(req, job, body, self._chat.choice(job.chat, 0, last)["message"])
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield events.emit(kind, response=body)
        except Exception as error:
            yield error_event(error)

    def _body(
        self, req: ResponsesRequest, job: _Job, out: RequestOutput | None, output: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The response object: in progress (no output yet), or finished with ``out``'s usage."""
        finish = out.outputs[0].finish_reason if out is not None else None
        status = "in_progress" if out is None else "incomplete" if finish == "length" else "completed"
        return {
            "id": job.id,
            "object": "response",
            "created_at": job.created_at,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "error": None,
            "model": self._config.served_model_name,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": _dumped(req.reasoning),
            "store": req.store,
            "temperature": job.chat.temperature,
            "top_p": job.chat.top_p,
            "text": _dumped(req.text) or {"format": {"type": "text"}},
            "tool_choice": _dumped(req.tool_choice) or "auto",
            "tools": [_dumped(t) for t in req.tools or []],
            "metadata": req.metadata or {},
            "usage": None if out is None else self._usage(out, output),
        }

    def _usage(self, out: RequestOutput, output: list[dict[str, Any]]) -> dict[str, Any]:
        prompt, generated = len(out.prompt_token_ids), out.outputs[0].token_ids
        reasoning = 0
        parser = self._config.reasoning_parser
        if parser is not None and any(item["type"] == "reasoning" for item in output):
            end = self._engine.tokenizer.token_to_id(REASONING_TOKENS[parser][1])
            reasoning = generated.index(end) + 1 if end in generated else len(generated)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": len(generated),
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + len(generated),
        }

    def _keep(self, req: ResponsesRequest, job: _Job, body: dict[str, Any], message: dict[str, Any]) -> None:
        if not req.store:
            return
        conversation = [*job.history, *input_messages(req.items()), _assistant_message(message)]
        self._stored[job.id] = _Stored(body, conversation)
        while len(self._stored) > STORED_RESPONSES:
            self._stored.popitem(last=False)


def _dumped(value: Any) -> Any:
    """A request field as the response echoes it (models as their JSON objects)."""
    return value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else value


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", param=param)


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    return (choice.get("logprobs") or {}).get("content") or []


def _assistant_message(message: dict[str, Any]) -> dict[str, Any]:
    """The chat message a continuation sees for this output."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": c["function"]} for c in message["tool_calls"]
        ]
    if message.get("reasoning") is not None:
        out["reasoning_content"] = message["reasoning"]
    return out


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def message_item(item_id: str, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def function_call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "id": _new_id("fc"),
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def output_items(message: dict[str, Any], logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chat message as Responses output items: reasoning, the text (unless the output is only tool
    calls), then the calls."""
    items = []
    if message.get("reasoning") is not None:
        items.append(reasoning_item(_new_id("rs"), message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(_new_id("msg"), message.get("content") or "", logprobs, "completed"))
    items.extend(function_call_item(c) for c in calls)
    return items


class ResponseEvents:
    """The typed events of one streamed response: chat deltas in, events out, the finished items
    kept (``output``) for the final event."""

    def __init__(self) -> None:
        self._sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self._text: list[str] = []

    def emit(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\n".encode() + sse(payload)

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        """The events of one chat delta: reasoning text, content text, whole tool calls."""
        out: list[bytes] = []
        if delta.get("reasoning"):
            out += self._text_delta("reasoning", delta["reasoning"])
        if delta.get("content"):
            out += self._text_delta("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self.close()
            out += self._call(call)
        return out

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._open is None or self._open["type"] != kind:
            out += self.close()
            out += self._open_item(kind)
        assert self._open is not None
        self._text.append(text)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.emit(name, **self._where(), content_index=0, delta=text, **extra))
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _open_item(self, kind: str) -> list[bytes]:
        if kind == "reasoning":
            self._open = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            self._open = {**message_item(_new_id("msg"), "", [], "in_progress"), "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._text = []
        return [
            self.emit("response.output_item.added", output_index=len(self.output), item=self._open),
            self.emit("response.content_part.added", **self._where(), content_index=0, part=part),
        ]

    def close(self) -> list[bytes]:
        """Ends the item being streamed, if any."""
        if self._open is None:
            return []
        text = "".join(self._text)
        if self._open["type"] == "reasoning":
            item = reasoning_item(self._open["id"], text)
            done = self.emit("response.reasoning_text.done", **self._where(), content_index=0, text=text)
        else:
            item = message_item(self._open["id"], text, [], "completed")
            done = self.emit(
                "response.output_text.done", **self._where(), content_index=0, text=text, logprobs=[]
            )
        part = item["content"][0]
        events = [
            done,
            self.emit("response.content_part.done", **self._where(), content_index=0, part=part),
            self.emit("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self._open = None
        return events

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        item = function_call_item(call)
        index = len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        self.output.append(item)
        return [
            self.emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self.emit("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self.emit(
                "response.function_call_arguments.done",
                **where,
                arguments=item["arguments"],
                name=item["name"],
            ),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]

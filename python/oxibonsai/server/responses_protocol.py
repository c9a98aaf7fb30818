"""The request of OpenAI's Responses API (``POST /v1/responses``), and its translation to a chat
completion request, so that one path renders, samples and parses both.

``input`` (a string, or a list of items: messages with text parts, ``function_call`` and
``function_call_output`` items, and ``reasoning`` items, whose text reaches the template as the next
assistant message's ``reasoning_content``) becomes the chat messages, after the ``instructions`` (a
system message) and, with ``previous_response_id``, after that response's conversation. Function
``tools`` (the Responses API's flat shape), ``tool_choice``, ``text.format`` (``json_object`` or
``json_schema``) and ``max_output_tokens`` map to their chat counterparts; the chat request's sampling
fields (vLLM's extensions included) pass through. What this server does not do is a 400: tool types
other than ``function``, ``background``, more than one completion (``n``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from oxibonsai.server.errors import APIError
from oxibonsai.server.protocol import ChatCompletionRequest, _SamplingFields

# The chat request's sampling fields a Responses request may carry as they are (vLLM's extensions).
_PASSED_THROUGH = (frozenset(_SamplingFields.model_fields) | {"chat_template_kwargs"}) - {
    "model", "n", "stream", "stream_options", "response_format", "logprobs",
}  # fmt: skip
_ROLES = frozenset({"user", "system", "developer", "assistant"})


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Other fields of the chat request's sampling set are kept in
    ``model_extra`` and passed on; fields this server ignores (``metadata``, ``include``, ``user``,
    ``truncation``, ``service_tier``) are accepted."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    _job: Any = PrivateAttr(default=None)  # what the serving keeps of an admitted request

    @property
    def job(self) -> Any:
        return self._job

    @job.setter
    def job(self, value: Any) -> None:
        self._job = value

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request that computes this response, after ``history`` (the messages
        of the response named by ``previous_response_id``, or none)."""
        if self.background:
            raise APIError(400, "background responses are not supported by this server", param="background")
        extra = dict(self.model_extra or {})
        if extra.get("n", 1) != 1:
            raise APIError(400, "the Responses API makes one completion per request", param="n")
        body: dict[str, Any] = {k: v for k, v in extra.items() if k in _PASSED_THROUGH}
        body["messages"] = self.messages(history)
        body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.top_logprobs is not None:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _chat_format(fmt)
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:  # as vLLM passes chat's reasoning_effort: to the template
            body["chat_template_kwargs"] = {
                **body.get("chat_template_kwargs", {}),
                "reasoning_effort": effort,
            }
        return ChatCompletionRequest.model_validate(body)

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages: the instructions, ``history``, then ``input``'s items."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        out.extend(history)
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not items:
            raise APIError(400, "input must be a string or a non-empty list of items", param="input")
        return out + input_messages(items)


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (function calls join the assistant message before
    them; a reasoning item's text goes to the next assistant message)."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = "".join(part.get("text", "") for part in item.get("content") or [])
            continue
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise APIError(400, f"input[{i}].role must be one of {sorted(_ROLES)}", param="input")
            message = {"role": item["role"], "content": _text_of(item.get("content"), i)}
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "")}
            if out and out[-1]["role"] == "assistant" and reasoning is None:
                out[-1].setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
        else:
            raise APIError(
                400, f"input[{i}] has type {kind!r}, which this server does not take", param="input"
            )
        if message["role"] == "assistant" and reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        out.append(message)
    return out


def _text_of(content: Any, index: int) -> Any:
    """A message's content as chat text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{index}].content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(
                400, f"input[{index}] has a content part of type {kind!r} (text only)", param="input"
            )
        texts.append(part.get("text"))
    return "".join(t for t in texts if isinstance(t, str))


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(
            400, f"tools of type {tool.get('type')!r} are not supported (function only)", param="tools"
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _chat_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format must be of type text, json_object or json_schema", param="text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}

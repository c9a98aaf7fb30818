"""The request of OpenAI's Responses API (``POST /v1/responses``), and its translation to a chat
completion request, so that one path renders, samples and parses both.

Every part of the request is a typed model, so a malformed one is a 400 naming its place in the
Responses request (``input.2.call_id``), never in the chat request it becomes. ``input`` (a string,
or a list of items: messages with text parts, ``function_call`` and ``function_call_output`` items,
and ``reasoning`` items, whose text reaches the template as the next assistant message's
``reasoning_content``) becomes the chat messages, after the ``instructions`` (a system message) and,
with ``previous_response_id``, after that response's conversation. Function ``tools`` (the Responses
API's flat shape), ``tool_choice``, ``text.format`` (``json_object`` or ``json_schema``) and
``max_output_tokens`` map to their chat counterparts; the chat request's sampling fields (vLLM's
extensions included) pass through. What this server does not do is a 400: content other than text,
tool types other than ``function``, ``background``, more than one completion (``n``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from oxibonsai.server.errors import APIError
from oxibonsai.server.protocol import ChatCompletionRequest, JobHolder, _SamplingFields

# The chat request's fields a Responses request may carry as they are (vLLM's extensions).
_PASSED_THROUGH = (frozenset(_SamplingFields.model_fields) | {"chat_template_kwargs"}) - {
    "model", "n", "stream", "stream_options", "response_format", "logprobs",
}  # fmt: skip
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Part):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ReasoningText(_Part):
    type: Literal["reasoning_text", "summary_text"]
    text: str


def _text_parts_only(content: Any) -> Any:
    """Names a content part this server cannot read (an image, a file) before pydantic does."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
    return content


def _joined(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(_Part):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    _parts = field_validator("content", mode="before")(lambda cls, v: _text_parts_only(v))


class FunctionCallItem(_Part):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Part):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    _parts = field_validator("output", mode="before")(lambda cls, v: _text_parts_only(v))


class ReasoningItem(_Part):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] | None = None


def _item_type(value: Any) -> str | None:
    """The tag of an input item (a message may leave ``type`` out); None for an unknown one."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _ITEM_TYPES else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="input_item",
        custom_error_message=f"an input item is a message or has a type of {', '.join(_ITEM_TYPES[1:])}",
    ),
]


class FunctionTool(_Part):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _function_only(cls, value: Any) -> Any:
        if value != "function":
            raise ValueError(f"tools of type {value!r} are not supported (function only)")
        return value


class NamedToolChoice(_Part):
    type: Literal["function"]
    name: str


class TextFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Part):
    format: TextFormat | None = None


class ReasoningConfig(_Part):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


def _one_message_if_text(value: Any) -> Any:
    """A string ``input`` is one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class ResponsesRequest(JobHolder):
    """``POST /v1/responses``. Fields of the chat request's sampling set are kept in ``model_extra``
    and passed on; fields this server ignores (``include``, ``user``, ``truncation``,
    ``service_tier``) are accepted."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: Annotated[list[InputItem], BeforeValidator(_one_message_if_text)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None

    def items(self) -> list[InputItem]:
        """``input``'s items (a string is one user message)."""
        if not self.input:
            raise APIError(400, "input must be a string or a non-empty list of items", param="input")
        return list(self.input)

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request that computes this response, after ``history`` (the messages
        of the response named by ``previous_response_id``, or none)."""
        if self.background:
            raise APIError(400, "background responses are not supported by this server", param="background")
        extra = dict(self.model_extra or {})
        if extra.get("n", 1) != 1:
            raise APIError(400, "the Responses API makes one completion per request", param="n")
        body: dict[str, Any] = {k: v for k, v in extra.items() if k in _PASSED_THROUGH}
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body["messages"] = [*system, *history, *input_messages(self.items())]
        body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": t.model_dump(
                        include={"name", "description", "parameters", "strict"}, exclude_none=True
                    ),
                }
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.top_logprobs is not None:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            body["response_format"] = _chat_format(fmt)
        if self.reasoning is not None and self.reasoning.effort is not None:  # as vLLM passes chat's
            kwargs = body.get("chat_template_kwargs")
            body["chat_template_kwargs"] = {
                **(kwargs if isinstance(kwargs, dict) else {}),
                "reasoning_effort": self.reasoning.effort,
            }
        return ChatCompletionRequest.model_validate(body)


def input_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages (function calls join the assistant message before them; a
    reasoning item's text goes to the next assistant message)."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = "".join(part.text for part in item.content or item.summary or [])
            continue
        if isinstance(item, MessageItem):
            message: dict[str, Any] = {"role": item.role, "content": _joined(item.content)}
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant" and reasoning is None:
                out[-1].setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
        else:
            message = {"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)}
        if message["role"] == "assistant" and reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        out.append(message)
    return out


def _chat_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.json_schema is None:
        raise APIError(400, "text.format of type json_schema needs its schema", param="text")
    schema = fmt.model_dump(include={"name", "description", "strict"}, exclude_none=True)
    return {"type": "json_schema", "json_schema": {**schema, "schema": fmt.json_schema}}

"""The request of Anthropic's Messages API (``POST /v1/messages``, and ``/v1/messages/count_tokens``),
and its translation to a chat completion request, so that one path renders, samples and parses both.

Every part is a typed model, so a malformed request is a 400 naming its place in the Messages request
(``messages.1.content.0.tool_use_id``). ``system`` becomes a system message; a user message's
``tool_result`` blocks become tool messages (before its text); an assistant message's ``text``,
``tool_use`` (arguments as JSON text) and ``thinking`` blocks become its content, tool calls and
``reasoning_content``. ``tools`` (``input_schema`` as the parameters), ``tool_choice`` (``auto``,
``any``, ``tool``, ``none``; ``disable_parallel_tool_use``), ``stop_sequences``, ``max_tokens``,
``output_config`` (``format``: a JSON schema the output follows; ``effort``, passed to the template as
``reasoning_effort``) and ``thinking`` (``disabled``, or any other type, passed to the template as
``enable_thinking``, with ``budget_tokens`` as the chat request's ``thinking_token_budget``) map to
their chat counterparts, as do the older
``temperature``, ``top_p`` and ``top_k``; the chat request's sampling fields (``seed``, ...) pass
through. A final assistant message with text is a prefill: the prompt ends inside it
(``continue_final_message``) and the answer continues it. Images, documents and server tools are
400s."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from oxibonsai.server.protocol import ChatCompletionRequest, JobHolder, _SamplingFields

_PASSED_THROUGH = (frozenset(_SamplingFields.model_fields) | {"chat_template_kwargs"}) - {
    "model", "n", "stream", "stream_options", "response_format", "logprobs", "stop", "temperature",
    "top_p", "top_k",
}  # fmt: skip
_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class _Block(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for block in value:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"tool_result content blocks of type {kind!r} are not supported (text only)"
                    )
        return value


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]


def _block_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _BLOCK_TYPES else None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(
        _block_type,
        custom_error_type="content_block",
        custom_error_message=f"content blocks are of type {', '.join(_BLOCK_TYPES)} (no images or documents)",
    ),
]


class Message(_Block):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self) -> list[dict[str, Any]]:
        blocks: list[Any] = (
            [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content
        )
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if self.role == "user":
            results = [
                {"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)}
                for b in blocks
                if isinstance(b, ToolResultBlock)
            ]
            return results + ([{"role": "user", "content": text}] if text or not results else [])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [b for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            message["tool_calls"] = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in calls
            ]
        thoughts = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
        if thoughts:
            message["reasoning_content"] = "".join(thoughts)
        return [message]


def _result_text(block: ToolResultBlock) -> str:
    return block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)


class Tool(_Block):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _custom_only(cls, value: Any) -> Any:
        if value not in (None, "custom"):
            raise ValueError(f"tools of type {value!r} (server tools) are not supported")
        return value


class ToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Block):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)


class JsonFormat(_Block):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Block):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonFormat | None = None


def _system_text(value: Any) -> Any:
    if isinstance(value, list):
        texts = []
        for i, block in enumerate(value):
            if (
                not isinstance(block, dict)
                or block.get("type") != "text"
                or not isinstance(block.get("text"), str)
            ):
                raise ValueError(f"system[{i}] must be a text block")
            texts.append(block["text"])
        return "\n".join(texts)
    return value


class MessagesRequest(JobHolder):
    """``POST /v1/messages`` (and ``/v1/messages/count_tokens``, which needs no ``max_tokens``)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    system: str | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None

    _system = field_validator("system", mode="before")(lambda cls, v: _system_text(v))

    def chat_request(self, *, counting: bool = False) -> ChatCompletionRequest:
        """The chat completion request that computes this message (``counting``: only its prompt is
        needed, so ``max_tokens`` may be left out)."""
        if self.max_tokens is None and not counting:
            raise ValueError("max_tokens: Field required")
        extra = dict(self.model_extra or {})
        body: dict[str, Any] = {k: v for k, v in extra.items() if k in _PASSED_THROUGH}
        system = [{"role": "system", "content": self.system}] if self.system else []
        body["messages"] = system + [m for message in self.messages for m in message.chat_messages()]
        last = body["messages"][-1]
        if last["role"] == "assistant" and last["content"].strip() and "tool_calls" not in last:
            # A final assistant message is a prefill: the answer continues it (Anthropic's rule).
            body.update(continue_final_message=True, add_generation_prompt=False)
        body["max_completion_tokens"] = self.max_tokens
        fields = {"stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p}
        fields["top_k"] = self.top_k if self.top_k else None  # 0: off, as in the chat request's -1
        body.update({k: v for k, v in fields.items() if v is not None})
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                        "strict": t.strict,
                    },
                }
                for t in self.tools
            ]
        if self.tool_choice is not None:
            body.update(self._chat_tool_choice(self.tool_choice))
        kwargs = body.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        if self.thinking is not None:
            kwargs["enable_thinking"] = self.thinking.type != "disabled"
            if self.thinking.type != "disabled" and self.thinking.budget_tokens is not None:
                body.setdefault("thinking_token_budget", self.thinking.budget_tokens)
        config = self.output_config
        if config is not None and config.effort is not None:
            kwargs["reasoning_effort"] = config.effort
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if config is not None and config.format is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"schema": config.format.json_schema},
            }
        return ChatCompletionRequest.model_validate(body)

    @staticmethod
    def _chat_tool_choice(choice: ToolChoice) -> dict[str, Any]:
        if choice.type == "tool":
            if not choice.name:
                raise ValueError("tool_choice: a choice of type tool needs the tool's name")
            picked: Any = {"type": "function", "function": {"name": choice.name}}
        else:
            picked = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        out: dict[str, Any] = {"tool_choice": picked}
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
        return out

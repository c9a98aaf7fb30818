"""Request models of the OpenAI-compatible API, with OpenAI's and vLLM's field names.

Validation happens here, at the edge: bodies are parsed as strict JSON (``model_validate_json``: invalid
UTF-8, lone surrogates, ``"10"`` for an int and ``1.5`` for a count are all rejected), every range is a
field constraint so a 400 names its field, and unknown fields are ignored as OpenAI's API does.
Structured output comes as OpenAI's ``response_format`` (``json_object``, or ``json_schema`` with its
``schema``, or vLLM's ``structural_tag``) or vLLM's ``structured_outputs`` extension (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``), on both endpoints; giving both
is a 400, as is a specification that does not compile (raised when the request is submitted).
``tool_choice`` ``"required"`` or a named function is forced the same way (``forced_tools``). Features
the engine does not have (request chat templates, ``suffix``) are refused with a 400 rather than
silently ignored. ``logit_bias`` keys are token ids as decimal strings (OpenAI's form), at most
``MAX_LOGIT_BIAS_ENTRIES`` of them. vLLM's ``allowed_token_ids`` and ``bad_words`` (at most
``MAX_BAD_WORDS``) are taken on both endpoints. ``sampling_params`` turns a validated request into the
engine's ``SamplingParams``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from oxibonsai.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from oxibonsai.sampling_params import MAX_LOGPROBS, SamplingParams
from oxibonsai.server.forced_tools import forced_calls_grammar, strict_calls_tag
from oxibonsai.server.tool_parser import CLOSE_TAG
from oxibonsai.structured_output import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_N = 128
MAX_LOGIT_BIAS_ENTRIES = 2048
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
COMPLETION_MAX_LOGPROBS = 5  # OpenAI's limit for the legacy completions API

MAX_BAD_WORDS = 128

Count = Annotated[int, Field(ge=0)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class JobHolder(BaseModel):
    """A request of an API translated to a chat request: ``job`` is what its serving keeps of it
    once admitted."""

    _job: Any = PrivateAttr(default=None)

    @property
    def job(self) -> Any:
        return self._job

    @job.setter
    def job(self, value: Any) -> None:
        self._job = value


class StreamOptions(_Strict):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is accepted: the output
    always follows the schema)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``, and vLLM's ``structural_tag`` form of it (``structures`` and
    ``triggers``; xgrammar's ``format`` form is refused by name)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[Any] | None = None
    triggers: list[Any] | None = None
    format: Any = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format json_schema needs json_schema.schema")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            assert self.json_schema is not None
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        if self.type == "structural_tag":
            fields = self.model_dump(include={"structures", "triggers", "format"}, exclude_none=True)
            return StructuredOutputsParams(structural_tag=fields)
        return None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` request field: exactly one of its constraints."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False

    def structured(self) -> StructuredOutputsParams:
        fields = self.model_dump(exclude_none=True)
        if "json_schema" in fields:
            fields["json"] = fields.pop("json_schema")
        return StructuredOutputsParams(**fields)


class _SamplingFields(_Strict):
    """The sampling fields both endpoints share."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    _structured: StructuredOutputsParams | None = PrivateAttr(default=None)
    user: str | None = None
    priority: int = Field(default=0, ge=INT32_MIN, le=INT32_MAX)
    cache_salt: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    bad_words: list[BadWord] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    thinking_token_budget: Count | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)

    # What beam search does not take (left at their defaults with use_beam_search); temperature and
    # seed are accepted and change nothing, as in vLLM (beams rank raw logprobs).
    BEAM_SEARCH_REFUSES: ClassVar[tuple[str, ...]] = (
        "stop", "stop_token_ids", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
        "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "thinking_token_budget",
        "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    )  # fmt: skip

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(items)}")
        for s in items:
            if not s:
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _check_salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}")
        for key in value:
            if not (key.isascii() and key.isdigit() and int(key) < 2**32):
                raise ValueError(f"logit_bias keys must be token ids (decimal strings), got {key!r}")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return self

    @model_validator(mode="after")
    def _check_structured(self) -> _SamplingFields:
        from_format = self.response_format.structured() if self.response_format is not None else None
        if from_format is not None and self.structured_outputs is not None:
            raise ValueError("give structured_outputs or a response_format other than text, not both")
        self._structured = from_format
        if self.structured_outputs is not None:
            self._structured = self.structured_outputs.structured()
        return self

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """vLLM's ``use_beam_search``: ``n`` beams (at most ``MAX_BEAM_WIDTH``), ``length_penalty``;
        ValueError naming a field beam search does not take."""
        if self.n > MAX_BEAM_WIDTH:
            raise ValueError(
                f"n is the beam width with use_beam_search: at most {MAX_BEAM_WIDTH}, got {self.n}"
            )
        fields = type(self).model_fields
        for name in self.BEAM_SEARCH_REFUSES:
            if getattr(self, name) != fields[name].default:
                raise ValueError(f"{name} is not supported with use_beam_search")
        if self._structured is not None:
            raise ValueError(
                "structured output (and a forced tool_choice) is not supported with use_beam_search"
            )
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
        )

    def include_usage(self, force: bool) -> bool:
        """Whether a stream ends with a usage chunk (asked for, or forced by the server)."""
        return force or (self.stream_options is not None and self.stream_options.include_usage)

    def server_stops(self) -> list[str]:
        """Stop strings the server adds to the request's own (none here)."""
        return []

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's parameters; fields left out take ``defaults`` (the model's recommended ones,
        ``oxibonsai.generation_config``), else vLLM's. ``max_tokens`` is the checked output budget; a
        negative ``seed`` is taken modulo 2**64."""
        given: dict[str, Any] = {
            name: getattr(self, name)
            for name in (
                "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty",
            )
            if getattr(self, name) is not None
        }  # fmt: skip
        given = {**(defaults or {}), **given}
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=None if self.seed is None else self.seed % 2**64,
            stop=[*_stop_list(self.stop), *self.server_stops()],
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()},
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self._structured,
            thinking_token_budget=self.thinking_token_budget,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            **given,
        )


def _stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


PromptField = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    BEAM_SEARCH_REFUSES = (*_SamplingFields.BEAM_SEARCH_REFUSES, "logprobs", "echo")

    prompt: PromptField
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=COMPLETION_MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: PromptField) -> PromptField:
        if isinstance(value, list) and not value:
            raise ValueError("the prompt list must not be empty")
        if isinstance(value, list) and isinstance(value[0], list) and not all(value):
            raise ValueError("a token-id prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (best-of sampling is not supported)")
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt (and its logprobs) alone; one token is generated
        and left out, as vLLM does."""
        return self.echo and self.max_tokens == 0

    @property
    def scored_prompt_logprobs(self) -> int | None:
        """How many top logprobs each prompt token needs: ``prompt_logprobs``, or ``logprobs`` with
        ``echo``, whichever is more."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any]


class ToolCallItem(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message. Content is a string or a list of text parts (joined with newlines); an assistant's
    earlier reasoning (``reasoning`` or ``reasoning_content``) reaches the template as
    ``reasoning_content``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None  # an assistant's earlier reasoning (vLLM's name)
    reasoning_content: str | None = None  # the same, by its older name

    @model_validator(mode="before")
    @classmethod
    def _name_unsupported_parts(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        return data

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: a string content, ``developer`` as ``system``."""
        content = self.content
        text = "\n".join(p.text for p in content) if isinstance(content, list) else (content or "")
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning  # the name Qwen3's template reads
        return out


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    BEAM_SEARCH_REFUSES = (*_SamplingFields.BEAM_SEARCH_REFUSES, "logprobs", "top_logprobs")

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        if self.tools is not None and not self.tools:
            raise ValueError("tools must not be an empty list")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        forced = self._forced_tool_grammar()
        if forced is not None:
            if self._structured is not None:
                raise ValueError("a forced tool_choice cannot be combined with structured output")
            self._structured = StructuredOutputsParams(grammar=forced)
        elif (
            self._structured is None
            and self.parses_tools()
            and any(t.function.strict for t in self.tools or [])
        ):
            functions = [t.function.model_dump() for t in self.tools or []]
            self._structured = StructuredOutputsParams(structural_tag=strict_calls_tag(functions))
        if self.chat_template is not None:
            raise ValueError("request chat templates are not accepted; the model's own template is used")
        return self

    def _forced_tool_grammar(self) -> str | None:
        """The grammar that forces ``tool_choice`` ``"required"`` or a named function; None when the
        choice is left to the model."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        if choice == "required":
            name = None
        elif isinstance(choice, dict) and choice.get("type") == "function":
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str):
                raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
        else:
            raise ValueError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}"
            )
        functions = [t.function.model_dump() for t in self.tools or []]
        return forced_calls_grammar(functions, name, self.parallel_tool_calls is not False)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def server_stops(self) -> list[str]:
        """With ``parallel_tool_calls: false`` and the choice to call left to the model, generation also
        stops where its first call closes (``stops_at_first_call``)."""
        return [CLOSE_TAG] if self.stops_at_first_call() else []

    def stops_at_first_call(self) -> bool:
        """Whether the output ends at the first ``</tool_call>``: ``parallel_tool_calls`` is false and
        ``tool_choice`` is ``"auto"`` (``"required"``'s grammar allows one call then, a named
        function's always one), unless the request's own ``stop`` has that string. OpenAI's rule is
        at most one call; vLLM drops the calls after the first, this also spends no tokens on them."""
        return (
            self.parallel_tool_calls is False
            and self.parses_tools()
            and self.tool_choice in (None, "auto")
            and CLOSE_TAG not in _stop_list(self.stop)
        )

    def ended_at_first_call(self, stop_reason: int | str | None) -> bool:
        """Whether an output stopped on ``stops_at_first_call``'s string, which its text then lacks
        (unless ``include_stop_str_in_output``)."""
        return stop_reason == CLOSE_TAG and self.stops_at_first_call()

    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def names_a_function(self) -> bool:
        """Whether ``tool_choice`` forces one named function (its call then ends with ``"stop"``)."""
        return isinstance(self.tool_choice, dict)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in self.tools]


class TokenizeRequest(_Strict):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``: OpenAI's fields, with vLLM's ``add_special_tokens``; ``dimensions``
    other than the model's is a 400 (its embeddings cannot be shortened)."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if not items:
            raise ValueError("input must not be empty")
        if len(items) > MAX_EMBEDDING_INPUTS and not isinstance(items[0], int):
            raise ValueError(f"input may hold at most {MAX_EMBEDDING_INPUTS} entries, got {len(items)}")
        return value

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding: a string or a token-id list."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if isinstance(value[0], int):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]

"""Chat templates: a model's jinja2 template rendered the way HF transformers renders it.

``ChatTemplate`` compiles the template once in an immutable sandbox with the settings, filters and
globals of transformers' ``apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``, loop controls,
a ``tojson`` that keeps non-ASCII text, ``raise_exception``, ``strftime_now``, and ``{% generation %}``
blocks rendered as plain text), validates the messages, and renders them to a prompt string. It knows
nothing of token ids: tokenizing the result is the tokenizer's job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """Raised by a template's ``raise_exception(...)``, or when a template cannot be compiled or rendered."""


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): plain text."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it as a set)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters and non-ASCII text, which templates do not want.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: object) -> list[Mapping[str, Any]]:
    """The messages as a list, or ValueError/TypeError saying which message is malformed and how."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for field in ("role", "content"):
            if field not in message:
                raise ValueError(f"messages[{i}] has no {field!r}")
            if not isinstance(message[field], str):
                kind = type(message[field]).__name__
                raise TypeError(f"messages[{i}][{field!r}] must be a str, got {kind}")
    return list(messages)


def open_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``rendered`` cut right after the text of the last message (transformers' rule for
    ``continue_final_message``: the last occurrence of that text, stripped), so a model continues the
    message instead of starting a new one; ``ValueError`` when the message has no text or the
    template does not render it verbatim."""
    final = str(messages[-1]["content"]).strip()
    if not final:
        raise ValueError("continue_final_message: the last message has no text to continue")
    if final not in rendered:
        raise ValueError("continue_final_message: the template does not render the last message's text as is")
    return rendered[: rendered.rindex(final) + len(final)]


class ChatTemplate:
    """One compiled chat template and the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self._special_tokens = dict(special_tokens)
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"the chat template does not compile: {err} (line {err.lineno})") from err

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages``; ``kwargs`` (e.g. ``enable_thinking``) become template variables."""
        context: dict[str, Any] = {**self._special_tokens, **kwargs}
        if tools is not None:
            tools = list(tools)
        try:
            return self._template.render(
                messages=validate_messages(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from err

"""Forced tool choice (``tool_choice`` ``"required"`` or a named function) and strict tools, made to
hold by structured output. The output is constrained to what the model writes when it calls tools on
its own (Qwen3's Hermes blocks, which ``tool_parser`` reads back), so a forced call is parsed,
streamed and reported like any other:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The call's JSON follows a schema: ``name`` one of the offered functions (or the named one) and
``arguments`` that function's ``parameters`` schema (``{}`` when it has none, as OpenAI reads it).
The JSON is laid out as Qwen3's chat template writes calls (``", "`` and ``": "`` between items, no
other whitespace), the form the model saw in training. ``"required"`` allows one call, or several
separated by newlines unless ``parallel_tool_calls`` is false; a named function gets exactly one call.
The grammar is llguidance's Lark with ``%json`` schemas.

With ``tool_choice`` ``"auto"`` and a tool marked ``strict`` (OpenAI's structured function calling),
the model still chooses whether to call: the text is free, but a ``<tool_call>`` it opens must go on
as one call of an offered function, the ``arguments`` of a strict one following its ``parameters``
(any JSON object for the others), in the same layout (``strict_calls_tag``, a structural tag)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from oxibonsai.server.tool_parser import CLOSE_TAG, OPEN_TAG

# JSON layout of a call: Python's json.dumps defaults, as Qwen3's template's tojson writes them.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# A function without parameters takes an empty parameter list (OpenAI's rule).
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or _NO_PARAMETERS
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_calls_grammar(functions: Sequence[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """The Lark grammar of output made only of tool calls: of ``name`` (exactly one) or, with ``name``
    None, of any of ``functions`` (``{"name", "parameters"}`` dicts; one call or, when ``parallel``,
    one or more)."""
    chosen = [f for f in functions if name is None or f["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
    schemas = [_call_schema(f) for f in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": _LAYOUT}
    repeat = ' ("\\n" block)*' if parallel and name is None else ""
    return "\n".join(
        [
            f"start: block{repeat}",
            f"block: {json.dumps(OPEN_TAG + chr(10))} call {json.dumps(chr(10) + CLOSE_TAG)}",
            f"call: %json {json.dumps(schema)}",
        ]
    )


def strict_calls_tag(functions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The structural tag (``structured_output``'s ``structural_tag``) under which every call the
    model opens is one of ``functions`` (``{"name", "parameters", "strict"}`` dicts), with the
    ``parameters`` schema of a strict one and any JSON object for the others."""
    structures = []
    for f in functions:
        parameters = (f.get("parameters") or _NO_PARAMETERS) if f.get("strict") else {"type": "object"}
        structures.append(
            {
                "begin": f'{OPEN_TAG}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
                "schema": {**parameters, "x-guidance": _LAYOUT},
                "end": f"}}\n{CLOSE_TAG}",
            }
        )
    return {"structures": structures, "triggers": [OPEN_TAG]}

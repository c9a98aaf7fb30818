"""Structural tags: free text in which each tagged segment must follow its own JSON schema (vLLM's
``structural_tag``, the form with ``structures`` and ``triggers``).

A specification is ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``. The model
writes whatever it likes until it emits a trigger; from there the output must continue one of the
structures whose ``begin`` starts with that trigger, then a JSON value its ``schema`` allows, then its
``end``, after which free text resumes. This is how tool calls in running text are constrained:
``{"begin": "<tool_call>", "schema": {...}, "end": "</tool_call>"}`` with the trigger
``"<tool_call>"``.

This module owns checking such a specification and turning it into an llguidance (Lark) grammar. A
trigger that is one added token of the vocabulary (Qwen3's ``<tool_call>``) is matched as that token;
any other trigger as text, however it is split into tokens (a lazy lexeme: the shortest text ending
with it). An added token's spelling inside a ``begin`` or ``end`` is asked for as that token too. Each
``begin`` must start with one of the triggers. Outside the tagged segments the text is free: any
text, and any added token but the trigger tokens and the stop tokens (which end it), so a model can
still think (``<think>``) without a reasoning parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any


def structural_tag_spec(value: str | dict[str, Any]) -> dict[str, Any]:
    """``value`` (a dict or its JSON text) as a checked specification; ValueError naming the part
    that is wrong."""
    value = _json_object(value, "structural_tag")
    if "format" in value:
        raise ValueError(
            "structural_tag: the 'format' form (xgrammar's) is not supported; "
            "give 'structures' and 'triggers'"
        )
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown:
        raise ValueError(f"structural_tag: unknown field {unknown[0]!r}")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag: type must be 'structural_tag', got {value['type']!r}")
    triggers = _triggers(value.get("triggers"))
    structures = value.get("structures")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag needs 'structures', a non-empty list")
    return {"structures": [_structure(s, triggers) for s in structures], "triggers": triggers}


def _json_object(value: Any, what: str) -> dict[str, Any]:
    """``value``, or the JSON text it is, as a dict; ValueError naming ``what`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{what} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _triggers(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ValueError("structural_tag needs 'triggers', a non-empty list of strings")
    bad = next((t for t in value if not isinstance(t, str) or not t), None)
    if bad is not None:
        raise ValueError(f"structural_tag: a trigger must be a non-empty string, got {bad!r}")
    return list(value)


def _structure(value: Any, triggers: list[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"structural_tag: a structure must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - {"begin", "schema", "end"})
    if unknown:
        raise ValueError(f"structural_tag: unknown structure field {unknown[0]!r}")
    begin, end, schema = value.get("begin"), value.get("end", ""), value.get("schema")
    if not isinstance(begin, str) or not begin:
        raise ValueError("structural_tag: a structure's 'begin' must be a non-empty string")
    if not isinstance(end, str):
        raise ValueError("structural_tag: a structure's 'end' must be a string")
    schema = _json_object(schema, f"structural_tag: the schema of {begin!r}")
    trigger = next((t for t in triggers if begin.startswith(t)), None)
    if trigger is None:
        raise ValueError(f"structural_tag: the begin {begin!r} starts with none of the triggers {triggers}")
    return {"begin": begin, "schema": schema, "end": end, "trigger": trigger}


def structural_tag_grammar(
    value: str | dict[str, Any],
    added_tokens: Mapping[str, int],
    stop_ids: Collection[int] = (),
    *,
    whitespace_flexible: bool = True,
) -> str:
    """The llguidance (Lark) grammar of the specification ``value``. ``added_tokens`` are the
    vocabulary's added tokens by spelling: where a trigger, begin or end spells one, the grammar asks
    for that token (the model's own ``<tool_call>``), not for its text in ordinary pieces; free text
    may hold the others but ``stop_ids`` (which end it). Without ``whitespace_flexible`` the JSON in
    the segments is compact."""
    spec = structural_tag_spec(value)
    literal = _literal_writer(added_tokens)
    rules = []
    for i, s in enumerate(spec["structures"]):
        trigger, rest = s["trigger"], s["begin"][len(s["trigger"]) :]
        if trigger not in added_tokens and literal(trigger) != json.dumps(trigger):
            raise ValueError(
                f"structural_tag: the trigger {trigger!r} holds an added token; a trigger is one added "
                "token or text without any"
            )
        # The schema's own layout options win (a tool call's is the chat template's).
        layout = {"whitespace_flexible": whitespace_flexible, **s["schema"].get("x-guidance", {})}
        schema = {**s["schema"], "x-guidance": layout}
        body = f"{literal(rest)} %json {json.dumps(schema)} {literal(s['end'])}"
        if trigger in added_tokens:
            # Text cannot hold an added token, so the text ends where the trigger token comes.
            rules.append(f"tag_{i}: TEXT <[{added_tokens[trigger]}]> {body}")
        else:
            # A lazy lexeme: the shortest text that ends with the trigger.
            rules += [f"tag_{i}_opens[lazy]: TEXT {json.dumps(trigger)}", f"tag_{i}: tag_{i}_opens {body}"]
    pieces = [f"tag_{i}" for i in range(len(spec["structures"]))]
    # The added tokens free text may hold: text, then such a token (as a trigger token is taken).
    triggers = {added_tokens[s["trigger"]] for s in spec["structures"] if s["trigger"] in added_tokens}
    free = sorted(set(added_tokens.values()) - triggers - set(stop_ids))
    if free:
        pieces.append("added")
        rules.append(f"added: TEXT <[{_id_ranges(free)}]>")
    head = ["%llguidance {}", f"start: ({' | '.join(pieces)})* TEXT", "TEXT: /(.|\\n)*/"]
    return "\n".join([*head, *rules]) + "\n"


def _id_ranges(ids: list[int]) -> str:
    """Sorted token ids as llguidance's token set: ``3-5,9``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _literal_writer(added_tokens: Mapping[str, int]) -> Callable[[str], str]:
    """A function writing a text as grammar literals: quoted text, with each added token's spelling
    in it as that token."""
    spellings = sorted(added_tokens, key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(t) for t in spellings)) if spellings else None

    def literal(text: str) -> str:
        if pattern is None:
            return json.dumps(text) if text else ""
        parts, start = [], 0
        for match in pattern.finditer(text):
            if match.start() > start:
                parts.append(json.dumps(text[start : match.start()]))
            parts.append(f"<[{added_tokens[match.group()]}]>")
            start = match.end()
        if start < len(text):
            parts.append(json.dumps(text[start:]))
        return " ".join(parts)

    return literal

"""Tool calls in Qwen3 / Hermes format, extracted from the model's output text.

Qwen3 answers a request that offered tools with blocks like::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several, possibly after some text. This module turns such text into ``(content, calls)``:
``parse_tool_calls`` for a finished output, ``StreamingToolParser`` for one fed delta by delta. Both
follow one rule, so streaming and non-streaming responses agree on any split of the same text:

* a block runs from ``<tool_call>`` to the first ``</tool_call>`` after it; its inner text must be a
  JSON object with a string ``"name"`` and ``"arguments"`` given as an object, as a string holding a
  JSON object (passed through unchanged), or left out / null (``"{}"``); other keys are ignored;
* a block that fails that test stays in the content verbatim, tags included, and so does an
  unterminated block at the end of the output;
* text after a tool call is kept as content (vLLM's ``hermes`` parser drops it when not streaming
  and sends it when streaming; keeping it loses nothing and makes the two modes agree).

The non-streaming content is stripped and None when empty; streamed content is sent unstripped, so
``"".join(streamed).strip()`` is the non-streaming content (``""`` for None). This module knows nothing
of HTTP, the OpenAI protocol or tokens: it maps text to text and ``ToolCall`` values.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for; ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """An OpenAI-style call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def _arguments_json(arguments: object) -> str | None:
    """The arguments as JSON object text, or None when they are not an object (or JSON text of one)."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return None
        return arguments if isinstance(decoded, dict) else None
    return None


def parse_block(inner: str) -> ToolCall | None:
    """The call in the text between the tags, or None when it is not a valid call."""
    try:
        payload = json.loads(inner)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = _arguments_json(payload.get("arguments"))
    if arguments is None:
        return None
    return ToolCall(id=new_call_id(), name=payload["name"], arguments=arguments)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls): content is the text outside valid tool-call blocks, stripped (None when empty);
    a block whose JSON does not parse, or lacks a string "name", stays in the content as text."""
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(OPEN_TAG, pos)) != -1:
        end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        if end == -1:
            break  # unterminated: the rest is content
        stop = end + len(CLOSE_TAG)
        call = parse_block(text[start + len(OPEN_TAG) : end])
        if call is None:
            pieces.append(text[pos:stop])
        else:
            pieces.append(text[pos:start])
            calls.append(call)
        pos = stop
    pieces.append(text[pos:])
    content = "".join(pieces).strip()
    return content or None, calls


def _open_tag_prefix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0


class StreamingToolParser:
    """Fed the model's text delta by delta (arbitrary splits, even inside the tags); returns what can be
    sent now. Text that might be the start of '<tool_call>' is held back until it is known not to be.

    Outside a block it holds at most ``len("<tool_call>") - 1`` characters; inside one it holds the
    block until ``</tool_call>`` arrives (a call is only sent whole, never as argument fragments).
    One parser per generated choice; it is not thread-safe.
    """

    def __init__(self) -> None:
        self._held = ""  # outside a block: a possible start of OPEN_TAG
        self._block: str | None = None  # inside a block: its text after OPEN_TAG so far

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to emit now, calls completed by this delta)."""
        text = self._held + delta
        self._held = ""
        content: list[str] = []
        calls: list[ToolCall] = []
        while text:
            if self._block is None:
                text = self._scan_outside(text, content)
            else:
                text = self._scan_block(text, content, calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of generation: flush held text; an unterminated block comes back as content."""
        rest = self._held if self._block is None else OPEN_TAG + self._block
        self._held, self._block = "", None
        return rest, []

    def _scan_outside(self, text: str, content: list[str]) -> str:
        """Emit text up to an opening tag (entering the block) or a possible partial tag (held)."""
        start = text.find(OPEN_TAG)
        if start != -1:
            content.append(text[:start])
            self._block = ""
            return text[start + len(OPEN_TAG) :]
        keep = _open_tag_prefix_len(text)
        content.append(text[: len(text) - keep])
        self._held = text[len(text) - keep :]
        return ""

    def _scan_block(self, text: str, content: list[str], calls: list[ToolCall]) -> str:
        """Add text to the open block; on its closing tag, emit the call (or the block as content)."""
        assert self._block is not None
        search_from = max(0, len(self._block) - len(CLOSE_TAG) + 1)
        block = self._block + text
        end = block.find(CLOSE_TAG, search_from)
        if end == -1:
            self._block = block
            return ""
        self._block = None
        call = parse_block(block[:end])
        if call is None:
            content.append(OPEN_TAG + block[: end + len(CLOSE_TAG)])
        else:
            calls.append(call)
        return block[end + len(CLOSE_TAG) :]

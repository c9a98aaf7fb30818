"""Reasoning text split from the answer, for ``--reasoning-parser qwen3``: an output that starts with
``<think>`` reasons until ``</think>``; that text becomes the message's ``reasoning`` (also sent as
``reasoning_content``, the older name many clients read) and the rest its ``content`` (where tool
calls are then looked for). An output that does not start with ``<think>`` is all content (Qwen3
with thinking off, whose template closes the block in the prompt), unless the prompt itself opened
the block (``opened``: its text ends with ``<think>`` and whitespace, as the templates of Qwen3-2507's
thinking models do), where the output starts inside it. One that ends inside the block (a length
limit) is all reasoning.

``split_reasoning`` reads a finished output, ``StreamingReasoningParser`` one fed delta by delta; both
follow one rule, so on any split of the same text ``"".join(reasoning deltas).strip()`` is the
reasoning and ``"".join(content deltas)`` the content (whitespace after ``</think>`` dropped in both).
This module maps text to text; it knows nothing of HTTP or tokens."""

from __future__ import annotations

from oxibonsai.structured_output import REASONING_TOKENS


def prompt_opens_reasoning(prompt: str | None, parser: str) -> bool:
    """Whether the prompt's text ends inside a reasoning block (its start tag, then only whitespace)."""
    return prompt is not None and prompt.rstrip().endswith(REASONING_TOKENS[parser][0])


def split_reasoning(text: str, parser: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a finished output: the reasoning stripped (None when neither the output
    nor the prompt, ``opened``, opens a block), the content with the whitespace after ``</think>``
    removed."""
    start, end = REASONING_TOKENS[parser]
    if opened:
        text = start + text
    if not text.startswith(start):
        return None, text
    inner, closed, rest = text[len(start) :].partition(end)
    return inner.strip(), rest.lstrip() if closed else ""


class StreamingReasoningParser:
    """``split_reasoning`` for text arriving in deltas: ``feed`` returns the reasoning and content each
    delta adds (text that may still turn into a tag is held back), ``finish`` what is held."""

    def __init__(self, parser: str, opened: bool = False) -> None:
        self._start, self._end = REASONING_TOKENS[parser]
        # "opening" -> "reasoning" (where a prompt that opened the block starts) -> "after" (whitespace
        # dropped) -> "content"
        self._phase = "reasoning" if opened else "opening"
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        if self._phase == "opening":
            if len(text) < len(self._start) and self._start.startswith(text):
                self._held = text  # still may be the opening tag
                return "", ""
            if not text.startswith(self._start):
                self._phase = "content"
                return "", text
            text = text[len(self._start) :]
            self._phase = "reasoning"
        reasoning = ""
        if self._phase == "reasoning":
            before, closed, text = text.partition(self._end)
            if not closed:
                keep = _tag_prefix_len(before, self._end)
                self._held = before[len(before) - keep :] if keep else ""
                return before[: len(before) - keep], ""
            reasoning, self._phase = before, "after"
        if self._phase == "after":
            text = text.lstrip()
            if not text:
                return reasoning, ""
            self._phase = "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """The held text: a partial opening tag is content, a partial closing tag reasoning."""
        held, self._held = self._held, ""
        return ("", held) if self._phase == "opening" else (held, "")


def _tag_prefix_len(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0

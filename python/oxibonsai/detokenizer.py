"""Streaming output text: token ids to text deltas, and stop strings applied to those deltas.

``IncrementalDetokenizer`` turns one sequence's generated ids into text as they arrive. It feeds each
token's bytes to an incremental UTF-8 decoder, so a character split across tokens is held back until
its last byte arrives and is never emitted half-done, at O(token bytes) per token whatever the length.
It applies the same rule as ``Tokenizer.decode`` (``oxibonsai._byte_level``), so the deltas always add
up to ``decode`` of the ids so far, up to bytes still waiting to complete a character.

``StopStringMatcher`` sits after it: it holds back text that could be the start of a stop string, so a
stop string never reaches the caller, and reports where generation must stop. Neither class knows
about the model, the sampler or token-level stop ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from oxibonsai.tokenizer import Tokenizer


class TextBuffer:
    """Text grown by appending pieces, in O(piece) per append: ``text += piece`` on an attribute copies
    the whole text each time (CPython extends a string in place only for a local variable). ``value``
    joins the pieces once and keeps the result."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def append(self, piece: str) -> None:
        if piece:
            self._parts.append(piece)

    def value(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


class IncrementalDetokenizer:
    """Text deltas of one sequence's generated tokens, never splitting a character.

    ``prompt_ids`` are checked but do not change the output: byte-level BPE text needs no left
    context (unlike SentencePiece), and the deltas add up to ``tokenizer.decode(output_ids)``.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._pieces = tokenizer.token_pieces
        for token_id in prompt_ids:
            self._pieces.check_id(token_id)
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = TextBuffer()
        self._token_ids: list[int] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All output text so far (the concatenation of every delta returned)."""
        return self._text.value()

    @property
    def token_ids(self) -> list[int]:
        """A copy of the output ids added so far."""
        return list(self._token_ids)

    @property
    def has_partial_character(self) -> bool:
        """Whether bytes of an unfinished character are being held back."""
        buffered, _ = self._utf8.getstate()
        return bool(buffered)

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the new text it completes (possibly empty)."""
        if self._finished:
            raise RuntimeError("add() after finish(): this detokenizer's sequence has ended")
        token_id = self._pieces.check_id(token_id)
        self._token_ids.append(token_id)
        added = self._pieces.added_text(token_id)
        if added is None:
            delta = self._utf8.decode(self._pieces.token_bytes(token_id))
        elif self._skip_special and self._pieces.is_control(token_id):
            delta = ""
        else:
            # An added token ends the byte run: unfinished bytes before it become U+FFFD.
            delta = self._utf8.decode(b"", final=True) + added
            self._utf8.reset()
        self._text.append(delta)
        return delta

    def finish(self) -> str:
        """End the sequence: held-back bytes of an unfinished character come out as U+FFFD.

        After this ``text == tokenizer.decode(token_ids, skip_special_tokens)`` exactly.
        """
        delta = "" if self._finished else self._utf8.decode(b"", final=True)
        self._finished = True
        self._text.append(delta)
        return delta


class StopStringMatcher:
    """Applies stop strings to streamed text so that no stop string is ever emitted.

    ``feed`` returns the text that is safe to emit now and whether a stop string has completed. Text
    that could still be the start of a stop string (at most ``max(len(stop)) - 1`` characters) is held
    back until it can no longer be. Generation stops at the first point where some stop string is
    complete; if several are complete there, the one that starts earliest wins. The emitted text ends
    just before that stop string (or just after it, with ``include_stop_str_in_output``), however the
    text was split into deltas.
    """

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a single str")
        for i, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stops[{i}] must be a non-empty str, got {stop!r}")
        self._stops = tuple(dict.fromkeys(stops))
        self._include = include_stop_str_in_output
        self._prefixes = frozenset(stop[:n] for stop in self._stops for n in range(1, len(stop)))
        self._longest_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None
        """The stop string that ended the text, or None."""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def watching(self) -> bool:
        """Whether there is any stop string to watch for (without one, ``feed`` passes text through)."""
        return bool(self._stops)

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add new text; returns (text safe to emit now, whether a stop string has completed)."""
        if self.matched is not None:
            return "", True
        text = self._held + delta
        hit = self._first_complete_stop(text)
        if hit is not None:
            start, stop = hit
            self.matched = stop
            self._held = ""
            return text[: start + len(stop)] if self._include else text[:start], True
        keep = self._held_back_length(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Generation ended for another reason: release the held-back text (nothing once stopped)."""
        held, self._held = self._held, ""
        return held

    def _first_complete_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the stop string that completes first in ``text``; ties go to the earlier start."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _held_back_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(self._longest_prefix, len(text)), 0, -1):
            if text[-n:] in self._prefixes:
                return n
        return 0

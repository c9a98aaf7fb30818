"""Byte-level BPE token pieces: the bytes (or verbatim text) that each token id stands for.

GPT-2-style vocabularies spell every byte as one printable character (``Ġ`` is the space byte), so a
token's text maps back to raw bytes. This module owns that mapping and the one decoding rule built on
it, shared by ``Tokenizer.decode`` and the incremental detokenizer so the two agree by construction:

* an ordinary token contributes bytes; consecutive bytes are decoded as UTF-8, each invalid or
  incomplete sequence becoming one U+FFFD;
* an added token (control or user-defined) contributes its text verbatim and ends the byte run
  before it, so bytes on either side of it never combine;
* a control token is dropped, without ending the byte run, when special tokens are skipped.

This is exactly what HF ``tokenizers`` (0.23) does with a ``ByteLevel`` decoder; the tests check it.
It never encodes text: that is the HF tokenizer's job.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character that spells it in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in printable}
    shifted = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(shifted)
            shifted += 1
    return mapping


@lru_cache(maxsize=1)
def _spelling_table() -> dict[int, int | None]:
    """``str.translate`` table: alphabet characters to the latin-1 character of their byte.

    Latin-1 characters outside the alphabet are deleted, so a token whose length changes (or whose
    result is not latin-1) had a character outside the alphabet.
    """
    table: dict[int, int | None] = {c: None for c in range(256)}
    table.update({ord(ch): b for b, ch in byte_to_unicode().items()})
    return table


def token_text_to_bytes(text: str) -> bytes:
    """The bytes a vocabulary token spells; its UTF-8 when it has characters outside the alphabet."""
    spelled = text.translate(_spelling_table())
    if len(spelled) == len(text):
        try:
            return spelled.encode("latin-1")
        except UnicodeEncodeError:
            pass
    return text.encode("utf-8")


class TokenPieces:
    """What each token id decodes to: bytes for ordinary tokens, verbatim text for added tokens."""

    __slots__ = ("_added", "_bytes", "_control")

    def __init__(self, tokens: Sequence[str], added: Mapping[int, str], control: Iterable[int]) -> None:
        self._bytes = [token_text_to_bytes(t) for t in tokens]
        self._added = dict(added)
        self._control = frozenset(control)

    def __len__(self) -> int:
        return len(self._bytes)

    def check_id(self, token_id: int) -> int:
        """``token_id`` as an int, or ValueError when it is not a valid id of this vocabulary."""
        try:
            index = operator.index(token_id)
        except TypeError:
            raise TypeError(f"token id must be an int, got {type(token_id).__name__}") from None
        if not 0 <= index < len(self._bytes):
            raise ValueError(f"token id {index} is out of range for a vocabulary of {len(self._bytes)}")
        return index

    def is_control(self, token_id: int) -> bool:
        return token_id in self._control

    def added_text(self, token_id: int) -> str | None:
        """The verbatim text of an added token, None for an ordinary token."""
        return self._added.get(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of an ordinary token (an added token's text as UTF-8)."""
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int], skip_control: bool) -> str:
        parts: list[str] = []
        run = bytearray()
        for raw in ids:
            token_id = self.check_id(raw)
            text = self._added.get(token_id)
            if text is None:
                run += self._bytes[token_id]
            elif not (skip_control and token_id in self._control):
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
                parts.append(text)
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

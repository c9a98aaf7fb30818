"""A request's fixed token constraints (vLLM's ``allowed_token_ids`` and ``bad_words``), in the forms
its sampling rows carry: an allow-bitmask, and banned ids.

- ``allowed_mask``: the int32 allow-bitmask (bit ``i % 32`` of word ``i // 32`` per id, the layout of
  structured output's masks) of the only ids a request may sample; ``both`` intersects it with a
  grammar's mask.
- ``BadWords``: each bad word as the token sequences that spell it at the start of the text and after
  a space (vLLM's rule: the word's own encoding, and the encoding of ``" " + word`` when that starts
  with another token and has as many). A one-token sequence bans its token at every step; a longer
  one bans its last token whenever the output ends with the rest of it, so the whole sequence is never
  generated (the prompt does not count, only the output).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def mask_words(vocab_size: int) -> int:
    """The int32 words of an allow-bitmask over ``vocab_size`` ids."""
    return (vocab_size + 31) // 32


def allowed_mask(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """The allow-bitmask of exactly ``ids`` (each in ``[0, vocab_size)``)."""
    words = np.zeros(mask_words(vocab_size), dtype=np.uint32)
    index = np.asarray(ids, dtype=np.int64)
    np.bitwise_or.at(words, index // 32, (np.uint32(1) << (index % 32).astype(np.uint32)))
    return words.view(np.int32)


def both(fixed: np.ndarray | None, grammar: np.ndarray | None) -> np.ndarray | None:
    """The ids both masks allow (None is every id). Where they have none in common the grammar's mask
    is kept: the output then stays valid for its grammar."""
    if fixed is None or grammar is None:
        return grammar if fixed is None else fixed
    common = fixed & grammar
    return common if common.any() else grammar


def leaves_a_token(mask: np.ndarray, banned: Sequence[int]) -> bool:
    """Whether the allow-bitmask ``mask`` allows some id outside ``banned``."""
    words = mask.view(np.uint32).copy()
    for t in banned:
        words[t // 32] &= ~np.uint32(1 << (t % 32))
    return bool(words.any())


def bad_word_sequences(words: Sequence[str], tokenizer: _Encoder) -> list[list[int]]:
    """The token sequences that spell each of ``words``, at the start of a text and after a space."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue  # only whitespace: no token spells it alone
        sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences


class BadWords:
    """The ids a request may not sample next so that its output spells none of its bad words."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.sequences = [list(seq) for seq in sequences]
        self.always = sorted({seq[0] for seq in sequences if len(seq) == 1})
        # the longer sequences, by the length of the prefix the output must end with
        self._after: dict[tuple[int, ...], set[int]] = {}
        for seq in sequences:
            if len(seq) > 1:
                self._after.setdefault(tuple(seq[:-1]), set()).add(seq[-1])
        self._prefix_lengths = sorted({len(p) for p in self._after})

    @classmethod
    def of(cls, words: Sequence[str], tokenizer: _Encoder) -> BadWords:
        return cls(bad_word_sequences(words, tokenizer))

    def token_ids(self) -> set[int]:
        """Every id in a bad word's sequences."""
        return {t for seq in self.sequences for t in seq}

    @property
    def depends_on_output(self) -> bool:
        """Whether some ban depends on the output's last tokens (a bad word of two or more tokens)."""
        return bool(self._after)

    def banned_after(self, output_ids: Sequence[int]) -> list[int]:
        """Every id banned after ``output_ids``: the one-token words' and those that would complete a
        longer word."""
        banned = set(self.always)
        for n in self._prefix_lengths:
            if n <= len(output_ids):
                banned |= self._after.get(tuple(output_ids[len(output_ids) - n :]), set())
        return sorted(banned)

"""The tokenizer section of GGUF metadata, read and validated in one place.

``GgufVocab.from_metadata`` turns the ``tokenizer.*`` keys of a GGUF metadata mapping into checked
Python values, raising ``ValueError`` naming the key for anything missing, mistyped or inconsistent.
It also owns the table of pre-tokenizer split patterns, keyed by ``tokenizer.ggml.pre`` as llama.cpp
names them (patterns as in the models' HF ``tokenizer.json``). It builds no tokenizer itself.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How text is split before BPE, and the defaults llama.cpp ties to that pre-tokenizer type."""

    pattern: str
    ignore_merges: bool = False
    add_bos_default: bool = False


# "default" is llama.cpp's fallback for a missing or unknown name; it runs several regexes in turn,
# which HF tokenizers cannot express, so it is approximated by GPT-2's pattern.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "qwen2": PreTokenizer(_QWEN2_PATTERN),
    "deepseek-r1-qwen": PreTokenizer(_QWEN2_PATTERN),
    "qwen35": PreTokenizer(_QWEN35_PATTERN),
    "gpt-2": PreTokenizer(_GPT2_PATTERN),
    "gpt2": PreTokenizer(_GPT2_PATTERN),
    "default": PreTokenizer(_GPT2_PATTERN),
    "llama-bpe": PreTokenizer(_LLAMA3_PATTERN, ignore_merges=True, add_bos_default=True),
    "llama3": PreTokenizer(_LLAMA3_PATTERN, ignore_merges=True, add_bos_default=True),
    "llama-v3": PreTokenizer(_LLAMA3_PATTERN, ignore_merges=True, add_bos_default=True),
}

_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding")


@dataclass(frozen=True)
class GgufVocab:
    """The validated ``tokenizer.*`` metadata of one GGUF file."""

    tokens: list[str]
    token_ids: dict[str, int]  # tokens[i] -> i
    token_types: list[int]
    merges: list[tuple[str, str]]
    pre: PreTokenizer
    special_ids: dict[str, int]  # "bos", "eos", ... -> id, only those present
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> GgufVocab:
        model = _get_str(meta, "tokenizer.ggml.model")
        if model is None:
            raise ValueError("missing 'tokenizer.ggml.model': the file has no tokenizer")
        if model != "gpt2":
            raise ValueError(
                f"unsupported tokenizer model {model!r} (only byte-level BPE 'gpt2' is supported)"
            )
        tokens, token_ids = _read_tokens(meta)
        token_types = _read_token_types(meta, len(tokens))
        merges = _read_merges(meta, token_ids)
        pre = _read_pre(meta)
        special_ids = {
            name: token_id
            for name in _SPECIAL_ID_KEYS
            if (token_id := _get_id(meta, f"tokenizer.ggml.{name}_token_id", len(tokens))) is not None
        }
        add_bos = _get_bool(meta, "tokenizer.ggml.add_bos_token", pre.add_bos_default)
        add_eos = _get_bool(meta, "tokenizer.ggml.add_eos_token", False)
        for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
            if flag and name not in special_ids:
                key = f"tokenizer.ggml.add_{name}_token"
                raise ValueError(f"'{key}' is true but 'tokenizer.ggml.{name}_token_id' is missing")
        chat_template = _get_str(meta, "tokenizer.chat_template")
        return cls(tokens, token_ids, token_types, merges, pre, special_ids, add_bos, add_eos, chat_template)


def _get_str(meta: Mapping[str, Any], key: str) -> str | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def _get_bool(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"'{key}' must be a bool, got {type(value).__name__}")
    return value


def _get_id(meta: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"'{key}' must be an integer token id, got bool")
    try:
        token_id = operator.index(value)
    except TypeError:
        raise ValueError(f"'{key}' must be an integer token id, got {type(value).__name__}") from None
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"'{key}' = {token_id} is out of range for a vocabulary of {vocab_size} tokens")
    return token_id


def _get_list(meta: Mapping[str, Any], key: str) -> Sequence[Any] | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(f"'{key}' must be an array, got {type(value).__name__}")
    return list(value)


def _read_tokens(meta: Mapping[str, Any]) -> tuple[list[str], dict[str, int]]:
    key = "tokenizer.ggml.tokens"
    tokens = _get_list(meta, key)
    if not tokens:
        raise ValueError(f"missing or empty '{key}'")
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not isinstance(token, str) or not token:
            raise ValueError(f"'{key}'[{i}] must be a non-empty string, got {token!r}")
        if token in seen:
            raise ValueError(f"'{key}' has {token!r} twice, at ids {seen[token]} and {i}")
        seen[token] = i
    return list(tokens), seen


def _read_token_types(meta: Mapping[str, Any], n_tokens: int) -> list[int]:
    key = "tokenizer.ggml.token_type"
    types = _get_list(meta, key)
    if types is None:
        return [TOKEN_NORMAL] * n_tokens
    if len(types) != n_tokens:
        raise ValueError(f"'{key}' has {len(types)} entries but 'tokenizer.ggml.tokens' has {n_tokens}")
    out: list[int] = []
    for i, value in enumerate(types):
        if isinstance(value, bool) or not hasattr(value, "__index__") or not 0 <= int(value) <= 6:
            raise ValueError(f"'{key}'[{i}] must be a token type 0..6, got {value!r}")
        out.append(int(value))
    return out


def _read_merges(meta: Mapping[str, Any], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    key = "tokenizer.ggml.merges"
    merges = _get_list(meta, key)
    if merges is None:
        raise ValueError(f"missing '{key}': a byte-level BPE tokenizer needs its merges")
    try:  # fast path for the usual ~150k well-formed merges; the slow one finds the culprit
        pairs = [(left, right) for left, right in (merge.split(" ") for merge in merges)]
    except (AttributeError, ValueError):
        pairs = []
    needed = {piece for pair in pairs for piece in pair}
    needed.update(left + right for left, right in pairs)
    if len(pairs) != len(merges) or not needed <= vocab.keys():
        _raise_for_first_bad_merge(key, merges, vocab)
    return pairs


def _raise_for_first_bad_merge(key: str, merges: Sequence[Any], vocab: Mapping[str, int]) -> None:
    for i, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"'{key}'[{i}] must be two tokens separated by one space, got {merge!r}")
        left, right = parts
        for piece in (left, right, left + right):
            if piece not in vocab:
                raise ValueError(f"'{key}'[{i}] = {merge!r}: {piece!r} is not in 'tokenizer.ggml.tokens'")


def _read_pre(meta: Mapping[str, Any]) -> PreTokenizer:
    key = "tokenizer.ggml.pre"
    name = _get_str(meta, key) or "default"
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        supported = ", ".join(sorted(PRE_TOKENIZERS))
        raise ValueError(f"unsupported pre-tokenizer {name!r} in '{key}'; supported: {supported}")
    return pre

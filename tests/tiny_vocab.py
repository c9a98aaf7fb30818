"""A minimal, valid byte-level BPE vocabulary in the form llama.cpp's converter writes for Qwen models.

`tokenizer_metadata(vocab_size)` returns the `tokenizer.*` GGUF keys of a GPT-2-style byte-level BPE:
the 256 byte symbols, merges for a handful of common English words (every merge's parts and result are
tokens, so any BPE implementation accepts it), the three ChatML control tokens, then plain padding
tokens up to `vocab_size`. Written from the GPT-2 byte-to-unicode rule, not from our tokenizer code;
the tests use it to check that code.
"""

from __future__ import annotations

from typing import Any

NORMAL, CONTROL = 1, 3  # gguf.TokenType values
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Words whose byte-level spelling gets merged left to right into one token each (" x" becomes "Ġx").
MERGED_WORDS = (
    " the", " and", " of", " to", " is", "ing", "er", "in", " Hello", "Hello", " world", " a",
    " you", " Hi", " user", " assistant", "\n\n",
)  # fmt: skip

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable latin-1 bytes stand for themselves, the other 68 are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def byte_level(text: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def merges_for(words: tuple[str, ...]) -> list[tuple[str, str]]:
    """Left-to-right merges building each word from its byte symbols, without duplicates."""
    merges: list[tuple[str, str]] = []
    for word in words:
        symbols = byte_level(word)
        prefix = symbols[0]
        for symbol in symbols[1:]:
            if (prefix, symbol) not in merges:
                merges.append((prefix, symbol))
            prefix += symbol
    return merges


def base_tokens() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) before padding: bytes, merged words, control tokens."""
    tokens = list(bytes_to_unicode().values())
    merges = merges_for(MERGED_WORDS)
    for left, right in merges:
        if left + right not in tokens:
            tokens.append(left + right)
    types = [NORMAL] * len(tokens)
    tokens += [ENDOFTEXT, IM_START, IM_END]
    types += [CONTROL] * 3
    return tokens, types, [f"{left} {right}" for left, right in merges]


def tokenizer_metadata(vocab_size: int) -> dict[str, Any]:
    """The `tokenizer.*` keys for a vocabulary padded with normal tokens `[PAD{i}]` to `vocab_size`."""
    tokens, types, merges = base_tokens()
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} < {len(tokens)} tokens of the minimal vocabulary")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [NORMAL] * (vocab_size - len(types))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index(IM_END),
        "tokenizer.ggml.padding_token_id": tokens.index(ENDOFTEXT),
        "tokenizer.ggml.bos_token_id": tokens.index(ENDOFTEXT),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }

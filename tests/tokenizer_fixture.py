"""A small Qwen3-style tokenizer, trained offline, and its GGUF ``tokenizer.*`` metadata.

``train_reference_tokenizer`` trains a byte-level BPE (Qwen2 pre-tokenizer, ChatML special tokens)
on CPython docstrings plus a little generated text; ``make_tokenizer_metadata`` exports it the way
llama.cpp's converter writes a Qwen3 GGUF: tokens by id, merges as ``"a b"`` strings, control type for
``<|...|>`` tokens and user-defined type for ``<think>``/``</think>``, ChatML chat template. Model tests
reuse it to put a tokenizer into test GGUF files.
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import random
import re
import string
import textwrap
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HfTokenizer

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED_TOKENS = ("<think>", "</think>")

# ChatML turns; with enable_thinking=False the generation prompt gets an empty think block (Qwen3).
QWEN3_CHAT_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


def _corpus() -> list[str]:
    texts = []
    for module in (collections, functools, inspect, json, re, string, textwrap):
        texts.append(inspect.getdoc(module) or "")
        texts += [inspect.getdoc(obj) or "" for name, obj in vars(module).items() if not name.startswith("_")]
    rnd = random.Random(1234)
    words = ["naïve", "café", "Straße", "über", "déjà", "year", "it's", "we'll", "I'm"]
    for _ in range(300):
        line = " ".join(rnd.choice(words) for _ in range(8))
        texts.append(f"{line} {rnd.randrange(10**6)}\r\n\t  {rnd.randrange(100)}.\n\n")
    return texts


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*CONTROL_TOKENS, *USER_DEFINED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(_corpus(), trainer)
    spec = json.loads(hf.to_str())
    for added in spec["added_tokens"]:  # as in Qwen3's tokenizer.json: <think> is not special
        added["special"] = added["content"] in CONTROL_TOKENS
    return json.dumps(spec)


def train_reference_tokenizer(vocab_size: int = 800) -> HfTokenizer:
    """A fresh copy of the trained HF tokenizer (training runs once per vocab size)."""
    return HfTokenizer.from_str(_trained_json(vocab_size))


def make_tokenizer_metadata(
    vocab_size: int = 800, *, chat_template: str | None = QWEN3_CHAT_TEMPLATE
) -> dict[str, Any]:
    """GGUF ``tokenizer.*`` metadata of the trained tokenizer, as llama.cpp's converter writes it."""
    spec = json.loads(_trained_json(vocab_size))
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))

    def token_type(token: str) -> int:
        return 3 if token in CONTROL_TOKENS else 4 if token in USER_DEFINED_TOKENS else 1

    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [token_type(t) for t in tokens],
        "tokenizer.ggml.merges": [" ".join(pair) for pair in spec["model"]["merges"]],
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
    }
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


def chatml(messages: list[dict[str, str]], generation_prompt: str | None = None) -> str:
    """The ChatML text ``QWEN3_CHAT_TEMPLATE`` should render, written out by hand."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + (generation_prompt or "")

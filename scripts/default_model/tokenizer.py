"""The default model's tokenizer: a byte-level BPE trained with HF ``tokenizers`` on the training
documents only, split the way Qwen2/Qwen3 split text (the ``qwen2`` pre-tokenizer pattern), with
Qwen's ChatML special tokens. The split pattern and the byte alphabet come from the package itself,
so the training environment needs oxibonsai installed. ``gguf_metadata`` writes the vocabulary the
way llama.cpp's converter writes a Qwen3 one, so the default model goes through the same loading path
as a real Bonsai file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HfTokenizer

from oxibonsai._byte_level import token_text_to_bytes
from oxibonsai._gguf_vocab import PRE_TOKENIZERS

# The split pattern llama.cpp names "qwen2" (Qwen2/Qwen3's tokenizer.json pre-tokenizer), as the
# engine's loader knows it.
QWEN2_SPLIT = PRE_TOKENIZERS["qwen2"].pattern
ENDOFTEXT = "<|endoftext|>"
CONTROL = (ENDOFTEXT, "<|im_start|>", "<|im_end|>")
USER_DEFINED = ("<think>", "</think>")
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# Qwen3's ChatML template, without tools: an optional system turn, the conversation, and with
# enable_thinking=False an empty think block after the generation prompt.
CHAT_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


def train(texts: Iterable[str], vocab_size: int) -> HfTokenizer:
    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*CONTROL, *USER_DEFINED],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return hf


def token_bytes(hf: HfTokenizer) -> list[bytes]:
    """The UTF-8 bytes each token stands for (empty for control tokens): bits-per-byte counts these."""
    out = [b""] * hf.get_vocab_size()
    for token, i in hf.get_vocab().items():
        if token not in CONTROL:
            out[i] = token.encode() if token in USER_DEFINED else token_text_to_bytes(token)
    return out


def gguf_metadata(hf: HfTokenizer) -> dict[str, Any]:
    """``tokenizer.*`` keys as llama.cpp's converter writes them for Qwen3."""
    spec = json.loads(hf.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("token ids are not dense")

    def token_type(token: str) -> int:
        return (
            TOKEN_CONTROL
            if token in CONTROL
            else TOKEN_USER_DEFINED
            if token in USER_DEFINED
            else TOKEN_NORMAL
        )

    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [token_type(t) for t in tokens],
        "tokenizer.ggml.merges": [" ".join(pair) for pair in spec["model"]["merges"]],
        # A base model, as Qwen3-Base: documents end with <|endoftext|>, chat turns with <|im_end|>.
        "tokenizer.ggml.eos_token_id": vocab[ENDOFTEXT],
        "tokenizer.ggml.eot_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": vocab[ENDOFTEXT],
        "tokenizer.ggml.bos_token_id": vocab[ENDOFTEXT],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }

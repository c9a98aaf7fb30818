r"""A tiny Qwen3 GGUF whose greedy output follows a fixed script, whatever the context.

Every attention and FFN matrix is Q1_0 with zero scales, so each layer adds nothing to the residual
stream and the final hidden state is the last token's own embedding (RMS-normalised, norm weights 1).
Embedding rows are ±1 sign vectors (Q1_0 stores them exactly): the tokens of the script's cycle
``start -> script[0] -> ... -> script[-1] -> start`` get distinct rows of a Sylvester Hadamard matrix,
hence exactly orthogonal; the other tokens get random signs. The untied output matrix's row for each
token ``s`` of the cycle is ``LOGIT_GAIN / hidden`` times the embedding of its predecessor, every
other row is zero. After a token ``p`` of the cycle, its successor's logit is ``LOGIT_GAIN`` and all
other logits are exactly 0, so greedy decoding walks the cycle. Script elements missing from the base
vocabulary (``make_tokenizer_metadata(800)``) become user-defined tokens, as Qwen3's ``<tool_call>``
is. ``QWEN3_TOOLS_TEMPLATE`` is a short ChatML template with Qwen3's tool-calling layout, so server
tests can render ``tools`` and make a real model answer with a tool call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np

from model_factory import (
    TensorSpec,
    TinyQwen3Config,
    add_hparams,
    add_metadata,
    q1_byte_shape,
    tensor_specs,
    write_tensors,
)
from q1_reference import quantize
from tiny_vocab import NORMAL, byte_level
from tokenizer_fixture import make_tokenizer_metadata

USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED

# A tool and the call a scripted model can be made to answer with (shared by the tool-call tests).
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HIDDEN = 256  # Hadamard rows: the cycle may hold at most this many tokens
LOGIT_GAIN = 20.0  # the successor's logit; every other logit after a cycle token is 0

# Qwen3's tool layout (its tokenizer_config.json), without the thinking/reasoning_content handling:
# tools go into the system turn, one JSON per line inside <tools></tools>; an assistant message's
# tool_calls (OpenAI {"function": {...}} or bare {"name", "arguments"}, arguments as object or JSON
# text) become <tool_call> blocks; consecutive tool messages share one user turn of <tool_response>s.
QWEN3_TOOLS_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + tool | tojson }}
{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if message.content or not loop.first %}
{{- '\n' }}
{%- endif %}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}
"""


def scripted_config(vocab_size: int) -> TinyQwen3Config:
    """One layer at hidden 256, with room for a prompt that renders tools."""
    return TinyQwen3Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        num_layers=1,
        context_length=2048,
        name="tiny-qwen3-scripted",
    )


def token_id(tokens: list[str], types: list[int], text: str) -> int:
    """The id of the token that decodes to ``text``, appending it as a user-defined token if none does.

    Added tokens (control, user-defined) are spelled verbatim; ordinary ones in GPT-2's byte alphabet.
    """
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if token == (byte_level(text) if kind == NORMAL else text):
            return i
    tokens.append(text)
    types.append(USER_DEFINED)
    return len(tokens) - 1


def hadamard(n: int) -> np.ndarray:
    """Sylvester's n x n Hadamard matrix (n a power of two): ±1 entries, orthogonal rows."""
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def scripted_weights(vocab: int, cycle: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(embedding, output) float matrices: cycle tokens on orthogonal sign rows, each output row the
    scaled embedding of its predecessor in the cycle."""
    if len(cycle) > HIDDEN:
        raise ValueError(f"a script of {len(cycle) - 1} tokens is longer than {HIDDEN - 1}")
    embedding = np.random.default_rng(0).choice(np.array([-1.0, 1.0], dtype=np.float32), size=(vocab, HIDDEN))
    embedding[cycle] = hadamard(HIDDEN)[: len(cycle)]
    output = np.zeros((vocab, HIDDEN), dtype=np.float32)
    for prev, token in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        output[token] = embedding[prev] * np.float32(LOGIT_GAIN / HIDDEN)
    return embedding, output


def tensor_maker(weights: dict[str, np.ndarray]) -> Callable[[TensorSpec], np.ndarray]:
    """Bytes or floats for each tensor: the given matrices quantized, other Q1_0 matrices all zero
    (zero scales), norm weights all one."""

    def make(spec: TensorSpec) -> np.ndarray:
        if spec.name in weights:
            raw = np.frombuffer(quantize(weights[spec.name]), dtype=np.uint8)
            return raw.reshape(q1_byte_shape(spec.shape))
        if spec.q1:
            return np.zeros(q1_byte_shape(spec.shape), dtype=np.uint8)
        return np.ones(spec.shape, dtype=np.float32)

    return make


def write_scripted_model(
    path: Path,
    script: Sequence[str],
    *,
    start: str = "\n",
    extra_tokens: Sequence[str] = (),
    chat_template: str = QWEN3_TOOLS_TEMPLATE,
) -> Path:
    """A model whose greedy generation, after any prompt ending in the token `start`, is exactly the tokens
    `script` (each element one token; elements not in the base vocabulary are added as user-defined tokens,
    like Qwen3's <tool_call>; all distinct and different from `start`). After the script it emits `start`
    and the script again; `extra_tokens` are only added to the vocabulary."""
    meta = make_tokenizer_metadata(800, chat_template=chat_template)
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    cycle = [token_id(tokens, types, text) for text in [start, *script]]
    if not script or len(set(cycle)) != len(cycle):
        raise ValueError("the script must be non-empty, its tokens distinct and different from start")
    for text in extra_tokens:
        token_id(tokens, types, text)
    meta.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    cfg = scripted_config(len(tokens))
    embedding, output = scripted_weights(len(tokens), cycle)
    writer = gguf.GGUFWriter(path, "qwen3")
    try:
        add_hparams(writer, cfg)
        add_metadata(writer, meta)
        weights = {"token_embd.weight": embedding, "output.weight": output}
        write_tensors(writer, tensor_specs(cfg, tied=False), tensor_maker(weights))
    finally:
        writer.close()
    return path

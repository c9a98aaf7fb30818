"""The model's tokenizer, built from the ``tokenizer.*`` metadata of its GGUF file.

``Tokenizer.from_gguf_metadata`` turns a byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``,
as in Qwen3/Bonsai files) into an HF ``tokenizers.Tokenizer`` that encodes exactly like the model's
original ``tokenizer.json``: the pre-tokenizer split pattern named by ``tokenizer.ggml.pre``, byte-level
BPE over the file's merges, and control/user-defined tokens matched whole. Decoding uses the per-token
byte pieces of ``oxibonsai._byte_level`` (the same rule as HF, shared with the incremental
detokenizer). Chat prompts come from ``tokenizer.chat_template`` (see ``oxibonsai.chat_template``).
This module owns text <-> ids; it never touches the model, sampling or stop strings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, SupportsIndex, overload

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

from oxibonsai._byte_level import TokenPieces
from oxibonsai._gguf_vocab import TOKEN_CONTROL, TOKEN_USER_DEFINED, GgufVocab
from oxibonsai.chat_template import ChatTemplate, open_final_message

# Tokens that end a turn in the vocabularies this package serves, besides the ids the file names.
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>")


def _build_hf(vocab: GgufVocab) -> HfTokenizer:
    bpe = models.BPE(
        vocab.token_ids,
        vocab.merges,
        unk_token=None,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=vocab.pre.ignore_merges,
    )
    hf = HfTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(vocab.pre.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    kinds = list(zip(vocab.tokens, vocab.token_types, strict=True))
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in kinds if kind == TOKEN_CONTROL]
    )
    hf.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in kinds if kind == TOKEN_USER_DEFINED]
    )
    return hf


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template. Build with ``from_gguf_metadata``."""

    def __init__(self, vocab: GgufVocab) -> None:
        self._vocab = vocab
        self._hf = _build_hf(vocab)
        kinds = vocab.token_types
        added = {i: t for i, t in enumerate(vocab.tokens) if kinds[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}
        control = [i for i in added if kinds[i] == TOKEN_CONTROL]
        self._pieces = TokenPieces(vocab.tokens, added, control)
        self._special_token_ids = frozenset(control)
        self._added_token_ids = MappingProxyType({text: i for i, text in added.items()})
        self._stop_token_ids = frozenset(self._find_stop_ids())
        self._chat_template: ChatTemplate | None = None

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata mapping; ValueError naming the key for bad tokenizer metadata."""
        return cls(GgufVocab.from_metadata(meta))

    def _find_stop_ids(self) -> list[int]:
        ids = [self._vocab.special_ids.get(name) for name in ("eos", "eot", "eom")]
        ids += [self._vocab.token_ids.get(text) for text in _END_OF_TURN_TEXTS]
        return [i for i in ids if i is not None]

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_token_id={self.eos_token_id})"

    @property
    def hf(self) -> HfTokenizer:
        """The underlying HF tokenizer (no BOS/EOS post-processor: ``encode`` adds those itself)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._vocab.special_ids.get("bos")

    @property
    def eos_token_id(self) -> int | None:
        return self._vocab.special_ids.get("eos")

    @property
    def pad_token_id(self) -> int | None:
        return self._vocab.special_ids.get("padding")

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS, EOT, EOM, and ``<|im_end|>``/``<|endoftext|>`` where present."""
        return self._stop_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Control tokens: matched whole when encoding, dropped by ``decode(skip_special_tokens=True)``."""
        return self._special_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._vocab.chat_template

    @property
    def token_pieces(self) -> TokenPieces:
        """Per-token bytes/texts shared by ``decode`` and ``IncrementalDetokenizer``."""
        return self._pieces

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS/EOS are added only when the file asks and ``add_special_tokens``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids: list[int] = self._hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._vocab.add_bos:
            ids.insert(0, self._vocab.special_ids["bos"])
        if add_special_tokens and self._vocab.add_eos:
            ids.append(self._vocab.special_ids["eos"])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete or invalid UTF-8 becomes U+FFFD, as in HF tokenizers."""
        return self._pieces.decode(ids, skip_special_tokens)

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str: ...
    @overload
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...
    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Vocabulary spellings (``"Ġworld"``) of one id or a sequence of ids."""
        if isinstance(ids, SupportsIndex):
            return self._vocab.tokens[self._pieces.check_id(ids)]
        return [self._vocab.tokens[self._pieces.check_id(i)] for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary spelling, or None."""
        return self._vocab.token_ids.get(token)

    @property
    def added_tokens(self) -> Mapping[str, int]:
        """The added tokens (control and user-defined: matched whole when encoding) by spelling."""
        return self._added_token_ids

    def _template(self) -> ChatTemplate:
        if self._chat_template is None:
            source = self._vocab.chat_template
            if source is None:
                raise ValueError(
                    "this model has no chat template ('tokenizer.chat_template' is missing from its "
                    "metadata); format the prompt yourself and use plain generation"
                )
            special = {
                f"{name}_token": self._vocab.tokens[i]
                for name, i in self._vocab.special_ids.items()
                if name in ("bos", "eos")
            }
            self._chat_template = ChatTemplate(source, special)
        return self._chat_template

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: Literal[False] = False,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str: ...
    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: Literal[True],
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]: ...
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's chat template, as HF ``apply_chat_template`` does.

        ``enable_thinking`` is passed to the template only when given; other ``kwargs`` become template
        variables too. With ``tokenize=True`` the prompt is encoded without adding BOS, special tokens
        in it mapping to their ids. ``continue_final_message`` (transformers' and vLLM's) leaves the
        last message open, the prompt ending right after its text, so the model continues it (an
        assistant prefill); it needs ``add_generation_prompt=False``. The template is compiled on first
        use; a model without one raises ``ValueError``, as does a template that fails
        (``ChatTemplateError``).
        """
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        prompt = self._template().render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        if continue_final_message:
            prompt = open_final_message(prompt, messages)
        return self.encode(prompt, add_special_tokens=False) if tokenize else prompt

"""Structured output: generation constrained to a JSON schema, any JSON object, a regex, a choice of
strings or a grammar (Lark, or llama.cpp's GBNF), with vLLM's ``StructuredOutputsParams``.

This module owns turning those parameters into a grammar and a per-request matcher. The grammar
engine is llguidance (imported only when a request asks for structured output). Before each of a
request's sampling steps, ``GrammarState.mask`` gives the ids the grammar allows next, as the
int32 allow-bitmask the Rust sampler (and the torch sampler) take. ``accept`` advances the grammar
by each token taken. ``done`` is true once the grammar can take no more tokens, and the engine then
ends the request (finish reason ``"stop"``). A stop token the grammar allows (at the end of a
complete value) ends the request as usual.

With a reasoning parser (``LLM(reasoning_parser="qwen3")``), a model may think first: the first token
may also be the reasoning start token (``<think>``), and if it is, the output is unconstrained until
the reasoning end token (``</think>``), after which the grammar begins (whitespace-only tokens right
after it, Qwen3's ``"\n\n"``, are let through first). A prompt that already opened the block (its
last token other than whitespace is ``<think>``) starts the output inside it. Without one, the grammar
constrains the output from its first token, so the model cannot think.

A compiled grammar is kept per distinct specification (``GrammarCompiler``, a small LRU behind a
lock: requests are checked on the caller's thread and added on the engine's), and each request gets
a copy of its matcher: repeated schemas, the common case on a server, compile once.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from oxibonsai.structural_tag import structural_tag_grammar, structural_tag_spec

if TYPE_CHECKING:
    import llguidance

    from oxibonsai.tokenizer import Tokenizer

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: The reasoning parsers and the texts of the tokens around their reasoning (vLLM's parser names).
REASONING_TOKENS = {"qwen3": ("<think>", "</think>")}
#: Compiled grammars kept per engine (each is a matcher at its start, copied per request).
GRAMMAR_CACHE_SIZE = 64


def _type_name(value: object) -> str:
    return type(value).__name__


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """What a request's output must match; exactly one of:

    - ``json``: a JSON schema (a dict, or its JSON text);
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: a list of strings, one of which the output is;
    - ``grammar``: a context-free grammar, in Lark syntax or llama.cpp's GBNF;
    - ``json_object``: ``True`` for any JSON object (OpenAI's ``response_format`` ``json_object``);
    - ``structural_tag``: free text whose tagged segments follow JSON schemas (vLLM's form with
      ``structures`` and ``triggers``, a dict or its JSON text; see ``oxibonsai.structural_tag``).

    ``disable_any_whitespace`` allows no whitespace between JSON tokens (compact JSON; small models
    otherwise can loop on whitespace). Values are checked when built; the grammar itself is compiled
    when the request is added (a bad schema or regex is a ``ValueError`` then)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(f"structured outputs need exactly one of {', '.join(_KINDS)}; got {named}")
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(f"json must be a JSON schema (dict or str), got {_type_name(self.json)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"{name} must be a non-empty str, got {_type_name(value)} {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise TypeError(f"choice must be a non-empty list of str, got {self.choice!r}")
            bad = next((c for c in self.choice if not isinstance(c, str) or not c), None)
            if bad is not None:
                raise TypeError(f"choice must hold non-empty strings, got {bad!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if self.structural_tag is not None:
            if not isinstance(self.structural_tag, (str, dict)):
                raise TypeError(
                    f"structural_tag must be a dict or its JSON text, got {_type_name(self.structural_tag)}"
                )
            structural_tag_spec(self.structural_tag)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be a bool, got {_type_name(self.json_object)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError("disable_any_whitespace must be a bool")

    def key(self) -> str:
        """A text naming this specification exactly (the compiled-grammar cache's key)."""
        kind = next(k for k in _KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return json.dumps([kind, text, self.disable_any_whitespace])


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as error:  # a dependency of the package; missing only in a broken install
        raise ImportError("structured output needs llguidance: pip install llguidance") from error
    return llguidance


def _grammar_text(llg: Any, spec: StructuredOutputsParams, tokenizer: Tokenizer) -> str:
    """The llguidance grammar of ``spec``; ValueError for a specification that is not valid text."""
    if spec.structural_tag is not None:
        return structural_tag_grammar(
            spec.structural_tag,
            tokenizer.added_tokens,
            tokenizer.stop_token_ids,
            whitespace_flexible=not spec.disable_any_whitespace,
        )
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"json is not a valid JSON schema text: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be a JSON object, got {_type_name(schema)}")
        return str(llg.LLMatcher.grammar_from_json_schema(schema, overrides=options))
    if spec.regex is not None:
        return str(llg.grammar_from("regex", spec.regex))
    if spec.choice is not None:
        return str(llg.grammar_from("choice", json.dumps(spec.choice)))
    assert spec.grammar is not None
    return str(llg.grammar_from("grammar", spec.grammar))


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into per-request ``GrammarState``s for one tokenizer and
    vocabulary (the model's, which may be larger than the tokenizer's); one per engine."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, reasoning_parser: str | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.reasoning = reasoning_token_ids(tokenizer, reasoning_parser)
        self._separators = _whitespace_mask(tokenizer, vocab_size) if self.reasoning is not None else None
        self._budget_reasoning: Reasoning | None = None
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer_for_grammars(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            llg = _llguidance()
            stops = sorted(self._tokenizer.stop_token_ids)
            self._ll_tokenizer = llg.LLTokenizer(
                self._tokenizer.hf.to_str(), n_vocab=self.vocab_size, eos_token=stops or None
            )
        return self._ll_tokenizer

    def prepare(self, spec: StructuredOutputsParams) -> None:
        """Compiles ``spec`` into the cache without making a matcher for a request; ValueError as
        ``compile``."""
        with self._lock:
            self._template(spec)

    def compile(self, spec: StructuredOutputsParams, prompt_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher for ``spec`` after ``prompt_ids`` (a prompt that opens a reasoning block
        starts it inside); ValueError naming the problem for an invalid schema, regex or grammar."""
        with self._lock:
            matcher = self._template(spec).deep_copy()
        if self.reasoning is None or self._separators is None:
            return GrammarState(matcher, self.vocab_size)
        reasoning = Reasoning(*self.reasoning, self._separators)
        return GrammarState(matcher, self.vocab_size, reasoning, opened=reasoning.opened_by(prompt_ids))

    def budget_reasoning(self) -> Reasoning:
        """The reasoning block's tokens a thinking budget counts between: the reasoning parser's, else
        Qwen3's (built once); ValueError for a vocabulary without them."""
        with self._lock:
            if self._budget_reasoning is None:
                ids = self.reasoning
                if ids is None:
                    try:
                        ids = reasoning_token_ids(self._tokenizer, "qwen3")
                    except ValueError:
                        raise ValueError(
                            "thinking_token_budget needs a reasoning block, but the vocabulary has no "
                            "<think> / </think> tokens"
                        ) from None
                separators = self._separators
                if separators is None:
                    separators = _whitespace_mask(self._tokenizer, self.vocab_size)
                self._budget_reasoning = Reasoning(*ids, separators)
            return self._budget_reasoning

    def _template(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        key = spec.key()
        template = self._compiled.get(key)
        if template is not None:
            self._compiled.move_to_end(key)
            return template
        llg = _llguidance()
        matcher: llguidance.LLMatcher = llg.LLMatcher(
            self._tokenizer_for_grammars(), _grammar_text(llg, spec, self._tokenizer), log_level=0
        )
        if matcher.is_error():
            raise ValueError(f"invalid structured output specification: {matcher.get_error()}")
        self._compiled[key] = matcher
        while len(self._compiled) > GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return matcher


def _whitespace_mask(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """The allow-bitmask of the ordinary tokens that are only whitespace (spaces, tabs, newlines)."""
    pieces = tokenizer.token_pieces
    special = tokenizer.special_token_ids
    allowed = np.zeros((vocab_size + 31) // 32 * 32, dtype=bool)
    for i in range(tokenizer.vocab_size):
        piece = pieces.token_bytes(i)
        allowed[i] = bool(piece) and i not in special and not piece.strip(b" \t\r\n")
    return np.packbits(allowed, bitorder="little").view(np.int32)


@dataclass(frozen=True)
class Reasoning:
    """A reasoning parser's start and end token ids, and the whitespace tokens allowed after the end."""

    start: int
    end: int
    separators: np.ndarray

    def is_separator(self, token: int) -> bool:
        return bool(int(self.separators[token // 32]) >> (token % 32) & 1)

    def opened_by(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt ends inside a reasoning block: its last token other than whitespace is
        the start token (a template that opens the block for the model, as Qwen3-2507's thinking
        models' does)."""
        for token in reversed(prompt_ids):
            if not self.is_separator(token):
                return token == self.start
        return False


def reasoning_token_ids(tokenizer: Tokenizer, parser: str | None) -> tuple[int, int] | None:
    """The ids of ``parser``'s reasoning start and end tokens (None without a parser); ValueError for
    an unknown parser or a vocabulary without them as single tokens."""
    if parser is None:
        return None
    if parser not in REASONING_TOKENS:
        raise ValueError(
            f"reasoning_parser must be one of {sorted(REASONING_TOKENS)} or None, got {parser!r}"
        )
    ids = [tokenizer.token_to_id(text) for text in REASONING_TOKENS[parser]]
    if ids[0] is None or ids[1] is None:
        raise ValueError(
            f"reasoning_parser {parser!r}: the vocabulary has no {' / '.join(REASONING_TOKENS[parser])} token"
        )
    return ids[0], ids[1]


class GrammarState:
    """One request's position in its grammar: the mask of its next token, and each token taken. With
    ``reasoning`` (start and end token ids), it first lets the model open a reasoning block, then
    constrains nothing until the block closes (the module doc)."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        reasoning: Reasoning | None = None,
        *,
        opened: bool = False,
    ) -> None:
        self._matcher = matcher
        self._words = (vocab_size + 31) // 32
        self._reasoning = reasoning
        # "start" (may open a reasoning block) -> "reasoning" -> "separator" (after its end) -> "grammar"
        self._phase = "grammar" if reasoning is None else "reasoning" if opened else "start"

    def mask(self) -> np.ndarray | None:
        """The int32 allow-bitmask of the next token (bit ``i % 32`` of word ``i // 32`` per id); None
        while the model reasons (nothing is constrained)."""
        if self._phase == "reasoning":
            return None
        mask = np.empty(self._words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if self._reasoning is not None and self._phase == "start":
            opener = self._reasoning.start
            mask.view(np.uint32)[opener // 32] |= np.uint32(1 << (opener % 32))
        elif self._reasoning is not None and self._phase == "separator":
            mask |= self._reasoning.separators
        return mask

    def accept(self, tokens: Iterable[int]) -> None:
        """Advances by ``tokens``: into, through and out of a reasoning block, else the grammar (sampled
        under its masks, so it accepts them; the rare token it refuses, e.g. a stop id the engine let
        through, leaves it in its error state, which ``done`` reports)."""
        for token in tokens:
            if not self._passes_outside_grammar(token) and not self._matcher.consume_token(token):
                return

    def _passes_outside_grammar(self, token: int) -> bool:
        """Moves through the reasoning phases; whether ``token`` is not the grammar's to consume."""
        r = self._reasoning
        if r is None or self._phase == "grammar":
            return False
        if self._phase == "start":
            self._phase = "reasoning" if token == r.start else "grammar"
            return token == r.start
        if self._phase == "reasoning":
            self._phase = "separator" if token == r.end else "reasoning"
            return True
        if r.is_separator(token):
            return True
        self._phase = "grammar"
        return False

    @property
    def reasoning(self) -> bool:
        """Whether the model is inside its reasoning block (the grammar waits)."""
        return self._phase == "reasoning"

    @property
    def done(self) -> bool:
        """Whether the grammar takes no more tokens: the value is complete, or it failed."""
        return self._phase == "grammar" and bool(self._matcher.is_stopped() or self._matcher.is_error())

    @property
    def error(self) -> str | None:
        return str(self._matcher.get_error()) if self._matcher.is_error() else None

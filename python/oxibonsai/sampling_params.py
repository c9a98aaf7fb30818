"""``SamplingParams``: how one request is sampled and when it stops, with vLLM's names and meanings.

The dataclass checks and normalizes every field when it is built (``__post_init__``), so the engine can
trust it: a wrong type raises ``TypeError``, a value out of range raises ``ValueError``, and both name
the field, what it accepts and what was given. ``stop`` and ``stop_token_ids`` become lists. This module
only validates; the sampling itself runs in Rust, in the sampler that :meth:`SamplingParams.sampler`
builds.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from oxibonsai import _core
from oxibonsai.logits_processors import LogitsProcessor, checked_processors
from oxibonsai.structured_output import StructuredOutputsParams

#: The most logprobs a request may ask for (vLLM's default limit).
MAX_LOGPROBS = 20
#: The largest ``logit_bias`` amount, either way (OpenAI's range).
MAX_LOGIT_BIAS = 100.0
_SEED_LIMIT = 2**64
_TOKEN_ID_LIMIT = 2**32


def _type_name(value: object) -> str:
    return type(value).__name__


def _as_int(name: str, value: object) -> int:
    """An int that is not a bool (``True`` is not a count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_type_name(value)} {value!r}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    """A real number (int or float, not bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_type_name(value)} {value!r}")
    return float(value)


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_type_name(value)} {value!r}")
    return value


def _out_of_range(name: str, allowed: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r}")


def _float_in(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> float:
    """A finite float for which ``ok(x)`` holds; NaN and infinities are always out of range."""
    x = _as_float(name, value)
    if not (math.isfinite(x) and ok(x)):
        raise _out_of_range(name, allowed, x)
    return x


def _stop_strings(value: object) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"stop must be a str, a list of str or None, got {_type_name(value)} {value!r}")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a str, got {_type_name(s)} {s!r}")
        if not s:
            raise ValueError(f"stop[{i}] must be a non-empty string, got ''")
    return list(items)


def _token_id_list(name: str, value: object) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of int or None, got {_type_name(value)} {value!r}")
    ids = [_as_int(f"{name}[{i}]", v) for i, v in enumerate(value)]
    for i, v in enumerate(ids):
        if not 0 <= v < _TOKEN_ID_LIMIT:
            raise _out_of_range(f"{name}[{i}]", f"a token id in [0, {_TOKEN_ID_LIMIT})", v)
    return ids


def _stop_token_ids(value: object) -> list[int]:
    return [] if value is None else _token_id_list("stop_token_ids", value)


def _logit_bias(value: object) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"logit_bias must be a dict of token id to number or None, got {_type_name(value)}")
    bias = {}
    for key, amount in value.items():
        token = _as_int(f"logit_bias key {key!r}", key)
        if not 0 <= token < _TOKEN_ID_LIMIT:
            raise _out_of_range(f"logit_bias key {key!r}", f"a token id in [0, {_TOKEN_ID_LIMIT})", token)
        bias[token] = _float_in(
            f"logit_bias[{token}]", amount, "in [-100, 100]", lambda x: abs(x) <= MAX_LOGIT_BIAS
        )
    return bias or None


def _allowed_token_ids(value: object) -> list[int] | None:
    if value is None:
        return None
    ids = _token_id_list("allowed_token_ids", value)
    if not ids:
        raise ValueError("allowed_token_ids must name at least one token id (None: every id), got []")
    return sorted(set(ids))


def _bad_words(value: object) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"bad_words must be a list of str or None, got {_type_name(value)} {value!r}")
    for i, word in enumerate(value):
        if not isinstance(word, str):
            raise TypeError(f"bad_words[{i}] must be a str, got {_type_name(word)} {word!r}")
        if not word.strip():
            raise ValueError(f"bad_words[{i}] must have a character other than whitespace, got {word!r}")
    return list(value) or None


def _truncate_prompt_tokens(value: object) -> int | None:
    if value is None:
        return None
    keep = _as_int("truncate_prompt_tokens", value)
    if keep < 1 and keep != -1:
        raise _out_of_range("truncate_prompt_tokens", "-1, >= 1 or None", keep)
    return keep


def truncated(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """``prompt_ids`` cut to their last ``keep`` (vLLM's ``truncate_prompt_tokens``: None keeps all, -1
    keeps ``max_model_len``); the same list when nothing is cut."""
    keep = _truncate_prompt_tokens(keep)
    if keep is None:
        return prompt_ids
    keep = max_model_len if keep == -1 else keep
    return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids


def _structured_outputs(value: object) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise TypeError(
            f"structured_outputs must be a StructuredOutputsParams (or a dict of its fields) or None, "
            f"got {_type_name(value)}"
        )
    fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise TypeError(f"structured_outputs has unknown field(s) {unknown}; known: {sorted(fields)}")
    return StructuredOutputsParams(**value)


@dataclass(kw_only=True)
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM's names, defaults and ranges).

    ``n`` samples of the prompt (``LLM.generate`` and the server run them as ``n`` requests, see
    ``for_sample``); ``top_k`` 0 or -1 turns top-k off; ``temperature`` 0 is greedy; ``seed`` None
    draws the request's seed from the engine; ``max_tokens`` None generates up to the context length;
    ``logprobs`` asks for that many top raw logprobs per token (None: none); ``prompt_logprobs`` as
    many for every prompt token after the first (``RequestOutput.prompt_logprobs``; such a request
    computes its whole prompt, the prefix cache cannot give it the logits). ``stop`` becomes a list
    of strings and ``stop_token_ids`` a list of ints. ``logit_bias`` maps token ids to amounts in
    [-100, 100] added to their logits before the penalties (-100 all but bans a token, +100 all but
    forces it; logprobs stay the raw ones); an empty dict becomes None. ``allowed_token_ids`` are the
    only ids that may be sampled (stop ids included: without them the request runs to its length);
    it becomes a sorted list without repeats. ``bad_words`` are never generated: a one-token word is
    banned at every step, a longer one's last token whenever the output ends with the rest of it,
    each as spelled at the start of a text and after a space (vLLM's rule). ``structured_outputs``
    constrains the output to a JSON schema, any JSON object, a regex, a choice or a grammar
    (``StructuredOutputsParams``; a dict of its fields is converted); the request ends, with finish
    reason ``"stop"``, once the value is complete. ``thinking_token_budget`` caps the tokens generated
    inside the reasoning block (``<think>`` ... ``</think>``): at the cap the engine forces ``</think>``
    and the model goes on to its answer (``oxibonsai.thinking_budget``; None: no cap).
    ``truncate_prompt_tokens`` keeps only the prompt's last that many tokens (-1: the context's
    length), as vLLM's does: a long history is cut from the left instead of refused.
    ``logits_processors`` are Python callables that rewrite the logits before each token is sampled
    (``oxibonsai.logits_processors``; host sampling only).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: list[LogitsProcessor] | None = None

    def __post_init__(self) -> None:
        self._check_lengths()
        self._check_sampling()
        self._check_stopping()

    def _check_lengths(self) -> None:
        self.n = _as_int("n", self.n)
        if self.n < 1:
            raise _out_of_range("n", ">= 1", self.n)
        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise _out_of_range("max_tokens", ">= 1 or None", self.max_tokens)
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise _out_of_range("min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _out_of_range("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        self.truncate_prompt_tokens = _truncate_prompt_tokens(self.truncate_prompt_tokens)

    def _check_sampling(self) -> None:
        self.temperature = _float_in(
            "temperature", self.temperature, "a finite number >= 0", lambda x: x >= 0
        )
        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise _out_of_range("top_k", "-1 or 0 (off) or >= 1", self.top_k)
        self.top_p = _float_in("top_p", self.top_p, "in (0, 1]", lambda x: 0 < x <= 1)
        self.min_p = _float_in("min_p", self.min_p, "in [0, 1]", lambda x: 0 <= x <= 1)
        self.repetition_penalty = _float_in(
            "repetition_penalty", self.repetition_penalty, "a finite number > 0", lambda x: x > 0
        )
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _float_in(name, getattr(self, name), "in [-2, 2]", lambda x: -2 <= x <= 2))
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            if not 0 <= self.seed < _SEED_LIMIT:
                raise _out_of_range("seed", "in [0, 2**64) or None", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _as_int(name, value))
                if not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                    raise _out_of_range(name, f"in [0, {MAX_LOGPROBS}] or None", value)
        self.logit_bias = _logit_bias(self.logit_bias)
        self.allowed_token_ids = _allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _bad_words(self.bad_words)
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        self.logits_processors = checked_processors(self.logits_processors)
        if self.thinking_token_budget is not None:
            self.thinking_token_budget = _as_int("thinking_token_budget", self.thinking_token_budget)
            if self.thinking_token_budget < 0:
                raise _out_of_range("thinking_token_budget", ">= 0 or None", self.thinking_token_budget)

    def _check_stopping(self) -> None:
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = _as_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)

    def truncated_prompt(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """``prompt_ids`` cut to their last ``truncate_prompt_tokens`` (-1: ``max_model_len``)."""
        return truncated(prompt_ids, self.truncate_prompt_tokens, max_model_len)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy (temperature 0 or top-k 1, as the float32 samplers see them) with no repetition,
        frequency or presence penalty, no logit bias, no logprobs, no allowed or bad token lists, no
        structured output and no logits processors: a draw is the first largest logit. (Ids banned
        before ``min_tokens`` are the engine's to check at each step.)"""
        greedy = np.float32(self.temperature) == 0 or self.top_k == 1
        plain = not self.has_penalties and self.logit_bias is None and self.logprobs is None
        plain = plain and self.structured_outputs is None
        plain = plain and self.allowed_token_ids is None and self.bad_words is None
        plain = plain and self.logits_processors is None
        return bool(greedy and plain)

    @property
    def has_penalties(self) -> bool:
        """A repetition, frequency or presence penalty, as the float32 samplers see them: a draw then
        depends on the request's tokens so far."""
        f32 = np.float32
        return bool(
            f32(self.repetition_penalty) != 1
            or f32(self.frequency_penalty) != 0
            or f32(self.presence_penalty) != 0
        )

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of ``n``, as one request: ``n`` 1, and a given seed
        becomes ``seed + index`` (mod 2**64), so samples differ and reproduce. Only sample 0 scores
        the prompt (``prompt_logprobs``): the others would score the same tokens again."""
        seed = None if self.seed is None else (self.seed + index) % _SEED_LIMIT
        if self.n == 1 and seed == self.seed:
            return self
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    def effective_seed(self, default_seed: int) -> int:
        """``seed``, or ``default_seed`` when it is None."""
        seed = self.seed if self.seed is not None else _as_int("default_seed", default_seed)
        if not 0 <= seed < _SEED_LIMIT:
            raise _out_of_range("default_seed", "in [0, 2**64)", seed)
        return seed

    def sampler(self, default_seed: int) -> _core.Sampler:
        """The native sampler of this request, seeded with ``effective_seed(default_seed)``."""
        seed = self.effective_seed(default_seed)
        return _core.Sampler(
            temperature=self.temperature,
            top_k=0 if self.top_k == -1 else min(self.top_k, _TOKEN_ID_LIMIT - 1),
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=seed,
            logit_bias=None if self.logit_bias is None else list(self.logit_bias.items()),
        )

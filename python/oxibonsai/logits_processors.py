"""Per-request logits processors (``SamplingParams.logits_processors``): Python callables that rewrite a
request's logits before each of its tokens is sampled, the hook vLLM's ``logits_processors`` (v0) and
llama-cpp-python's ``logits_processor`` give.

A processor is called as ``fn(output_token_ids, logits)`` or, when it takes three arguments,
``fn(prompt_token_ids, output_token_ids, logits)``: the ids are lists (copies), ``logits`` a writable
float32 array over the vocabulary that it may change in place; it returns the logits to use (an array
of the same shape; ``None`` keeps the array it was given). Processors run in order on the raw logits,
before ``logit_bias``, the penalties and the rest of sampling; the logprobs a request reports are
those of the processed logits. They run on the host, in the engine's thread, once per sampled token.

A processor that raises ends its own request only: ``processed`` lets the error out, the runner
turns it into a ``FailedDraw`` for that row, and the engine finishes the request (``"abort"``) and
hands the error to its caller (``LLM.generate`` raises it; an ``AsyncLLM`` stream raises it), while the
other requests of the step go on."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

LogitsProcessor = Callable[..., Any]
# Each processor's arity, read from its signature once (not per token); weak, so a request's lambda
# goes with the request.
_ARITIES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def checked_processors(value: object) -> list[LogitsProcessor] | None:
    """``value`` as a list of processors (None or empty: none); TypeError naming a bad item."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"logits_processors must be a list of callables or None, got {type(value).__name__}")
    for i, fn in enumerate(value):
        if not callable(fn):
            raise TypeError(f"logits_processors[{i}] must be callable, got {type(fn).__name__}")
        _arity(fn, f"logits_processors[{i}]")
    return list(value) or None


def _arity(fn: LogitsProcessor, name: str = "a logits processor") -> int:
    try:
        return _ARITIES[fn]
    except (KeyError, TypeError):  # not seen yet, or not weakly referenceable
        pass
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise TypeError(f"{name}: its signature cannot be read") from None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) not in (2, 3):
        raise TypeError(
            f"{name} must take (output_token_ids, logits) or (prompt_token_ids, output_token_ids, "
            f"logits), got {len(positional)} positional parameters"
        )
    try:
        _ARITIES[fn] = len(positional)
    except TypeError:
        pass
    return len(positional)


def processed(
    processors: Sequence[LogitsProcessor], prompt_ids: list[int], output_ids: list[int], row: np.ndarray
) -> np.ndarray:
    """``row`` (one request's float32 logits) through each processor in turn, on a copy."""
    logits = np.array(row, dtype=np.float32)
    for fn in processors:
        args = (list(output_ids), logits) if _arity(fn) == 2 else (list(prompt_ids), list(output_ids), logits)
        out = fn(*args)
        if out is not None:
            out = np.asarray(out, dtype=np.float32)
            if out.shape != row.shape:
                raise ValueError(f"a logits processor returned shape {out.shape}, not {row.shape}")
            logits = out
    return logits


class FailedDraw(tuple):  # type: ignore[type-arg]
    """The draw of a row whose logits processor raised: token 0 (for the scheduler's ledger; the
    engine never takes it) and the error, which the engine hands to the request's caller."""

    error: BaseException

    def __new__(cls, error: BaseException) -> FailedDraw:
        draw = super().__new__(cls, (0, None, []))
        draw.error = error
        return draw

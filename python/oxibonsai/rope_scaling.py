"""``RopeScaling``: how a model's rotary position embedding is stretched past the context it was
trained on, in Hugging Face's ``rope_scaling`` terms, as vLLM's ``rope_scaling`` argument takes them
(``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}``, Qwen3's recipe
for 131,072 tokens). A GGUF file may carry the same in its ``qwen3.rope.scaling.*`` keys (llama.cpp's
names), which the loaders read; a ``RopeScaling`` given to ``LLM`` replaces them. This module only
checks and parses; the frequencies are computed by the Rust core (``_core.rope_frequencies``), for the
native and the torch runner alike."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from oxibonsai.json_arg import json_mapping

ROPE_TYPES = ("default", "linear", "yarn")
_MAX_CONTEXT = 1 << 24


@dataclass(frozen=True)
class RopeScaling:
    """``rope_type``: ``"yarn"``, ``"linear"`` (every angle divided by ``factor``) or ``"default"``
    (none: turns off a file's scaling). ``factor`` >= 1 stretches the longest ``max_model_len`` to
    ``factor`` x ``original_max_position_embeddings`` (YaRN; default: the file's context length) or
    ``factor`` x the context length (linear). YaRN keeps the frequency pairs that turn more than
    ``beta_fast`` times over the original context, interpolates those turning fewer than
    ``beta_slow`` times, ramps between them, and multiplies cos and sin by ``attention_factor``
    (default ``0.1 ln(factor) + 1``)."""

    rope_type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; oxibonsai runs {', '.join(ROPE_TYPES)}"
            )
        _require("factor", self.factor, self.factor >= 1.0)
        original = self.original_max_position_embeddings
        if original is not None and (
            isinstance(original, bool) or not isinstance(original, int) or not 0 < original <= _MAX_CONTEXT
        ):
            raise ValueError(
                f"original_max_position_embeddings must be in 1..={_MAX_CONTEXT}, got {original!r}"
            )
        _require("beta_slow", self.beta_slow, self.beta_slow > 0.0)
        _require("beta_fast", self.beta_fast, self.beta_fast > self.beta_slow)
        if self.attention_factor is not None:
            _require("attention_factor", self.attention_factor, self.attention_factor > 0.0)

    @classmethod
    def parse(cls, value: RopeScaling | Mapping[str, Any] | str | None) -> RopeScaling | None:
        """A ``RopeScaling`` from itself, a Hugging Face ``rope_scaling`` dict (``"type"`` is the older
        name of ``"rope_type"``) or that dict as JSON (the CLI's ``--rope-scaling``); None stays None.
        Keys this engine does not implement are refused, not ignored."""
        if value is None or isinstance(value, RopeScaling):
            return value
        value = json_mapping(value, "rope_scaling")
        items = dict(value)
        if "type" in items:
            legacy = items.pop("type")
            if items.setdefault("rope_type", legacy) != legacy:
                raise ValueError("rope_scaling gives both 'type' and 'rope_type', and they differ")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(items) - known)
        if unknown:
            raise ValueError(
                f"rope_scaling keys not supported: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        if "rope_type" not in items:
            raise ValueError("rope_scaling needs a 'rope_type'")
        return cls(**items)

    def resolved(self, context_length: int) -> RopeScaling:
        """This scaling with its defaults made explicit for a file of ``context_length`` (what the
        native loader reports): YaRN's original context and attention factor."""
        if self.rope_type != "yarn":
            return self
        return replace(
            self,
            original_max_position_embeddings=self.original_max_position_embeddings or context_length,
            attention_factor=self.attention_factor or default_attention_factor(self.factor),
        )

    def max_positions(self, context_length: int) -> int:
        """The longest sequence the scaled positions are meant for (vLLM's rule, as the native
        loader's): ``factor`` x the original context, never less than the file's context length."""
        if self.rope_type == "default":
            return context_length
        original = self.original_max_position_embeddings if self.rope_type == "yarn" else None
        return max(context_length, int((original or context_length) * self.factor))

    def as_dict(self) -> dict[str, Any]:
        """The Hugging Face dict (unset optional fields left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def default_attention_factor(factor: float) -> float:
    """YaRN's cos/sin multiplier when none is given (Hugging Face's ``get_mscale``)."""
    return 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0


def _require(name: str, value: float, ok: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok:
        raise ValueError(f"rope_scaling {name} is out of range: {value!r}")

"""A model's own sampling defaults: the ``general.sampling.*`` keys llama.cpp's converter writes into a
GGUF from the model's ``generation_config.json`` (``temp``, ``top_k``, ``top_p``, ``min_p``,
``penalty_repeat``). As vLLM applies a model's generation config (its ``--generation-config auto``, the
default) and llama.cpp these keys, they fill the ``SamplingParams`` fields a caller leaves unset:
``LLM.generate`` without parameters (``LLM.get_default_sampling_params()``), the server's requests,
the CLI's flags. ``generation_config="vllm"`` ignores them (vLLM's spelling: the library's defaults).

Keys without a ``SamplingParams`` field here are not read (``penalty_last_n``: our repetition penalty
covers the whole context, as vLLM's; ``xtc_*``, ``mirostat*``, ``sequence``). A value of the wrong
type or out of its field's range is skipped with a warning, so a bad hint never stops the model."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from oxibonsai.sampling_params import SamplingParams

GENERATION_CONFIGS = ("auto", "vllm")

# GGUF key -> SamplingParams field
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def check_generation_config(value: str) -> str:
    if value not in GENERATION_CONFIGS:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, got {value!r}")
    return value


def model_sampling_defaults(metadata: Mapping[str, Any], generation_config: str = "auto") -> dict[str, Any]:
    """The ``SamplingParams`` fields the GGUF's ``general.sampling.*`` keys give (none with
    ``generation_config="vllm"``), each checked as ``SamplingParams`` checks it."""
    if check_generation_config(generation_config) == "vllm":
        return {}
    defaults: dict[str, Any] = {}
    for key, field in GGUF_SAMPLING_KEYS.items():
        if key not in metadata:
            continue
        value = _number(metadata[key], integer=field == "top_k")
        try:
            if value is None:
                raise ValueError("not a number")
            SamplingParams(**{field: value})
        except (TypeError, ValueError) as error:
            warnings.warn(f"the GGUF's {key} = {metadata[key]!r} is not used: {error}", stacklevel=2)
            continue
        defaults[field] = value
    return defaults


def _number(value: object, *, integer: bool) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if integer:
        return int(value) if float(value).is_integer() else None
    # A float32 key (as the converter writes them) as its shortest decimal: 0.95, not 0.949999988.
    return float(str(np.float32(value))) if float(np.float32(value)) == value else float(value)

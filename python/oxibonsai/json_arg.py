"""One helper for engine arguments given as a dict or as that dict's JSON (``--rope-scaling``,
``--speculative-config``): the mapping, or a ``ValueError`` naming the argument."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def json_mapping(value: Mapping[str, Any] | str, name: str) -> Mapping[str, Any]:
    """``value`` itself if a mapping, parsed if a JSON string; ValueError otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict (or its JSON), got {type(value).__name__}")
    return value

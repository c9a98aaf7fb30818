"""Errors as OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``.

``APIError`` is what the serving code raises; ``error_from_exception`` is the one place that maps the
engine's and pydantic's exceptions to a status, a type and a field (``param``). Messages are kept short
and free of object addresses and tracebacks, and never repeat more than a few characters of input."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pydantic

from oxibonsai import QueueFull
from oxibonsai.async_llm import EngineDeadError
from oxibonsai.sampling_params import SamplingParams

#: How many validation problems one 400 lists (a body of 5,000 bad messages gets a short answer).
MAX_LISTED_ERRORS = 3
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_LEADING_FIELD = re.compile(r"^([a-z_]+)(?:\[\d+\])?\b")
#: Fields a ``SamplingParams`` error message may start with (it names the field first).
_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))

_TYPES = {
    400: "BadRequestError",
    401: "authentication_error",
    404: "NotFoundError",
    413: "request_too_large",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answer: HTTP status, message, OpenAI error type, the offending field, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = sanitize(message)
        self.param = param
        self.type = type or _TYPES.get(status, "error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }

    def json_bytes(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()


def sanitize(message: str) -> str:
    """No object addresses; at most 2,000 characters."""
    message = _ADDRESS.sub("", message)
    return message if len(message) <= 2000 else message[:1997] + "..."


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def not_found_model(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model")


def overloaded(status: int, retry_after_s: int) -> APIError:
    return APIError(
        status,
        "The server is overloaded: the waiting queue is full. Retry later.",
        headers={"Retry-After": str(retry_after_s)},
    )


def validation_error(err: pydantic.ValidationError) -> APIError:
    """A 400 naming the first bad field, listing at most ``MAX_LISTED_ERRORS`` problems."""
    errors = err.errors(include_url=False, include_input=False)
    messages = [e["msg"].removeprefix("Value error, ") for e in errors]
    parts = [f"{_loc_text(e['loc'])}: {m}" if e["loc"] else m for e, m in zip(errors, messages, strict=True)]
    shown = "; ".join(parts[:MAX_LISTED_ERRORS])
    if len(parts) > MAX_LISTED_ERRORS:
        shown += f" (and {len(parts) - MAX_LISTED_ERRORS} more)"
    first = errors[0]["loc"] if errors else ()
    param = str(first[0]) if first and isinstance(first[0], str) else None
    return bad_request(shown, param)


def _loc_text(loc: tuple[int | str, ...]) -> str:
    # Union members show up as 'str' / 'list[int]' steps; they say nothing to a client.
    steps = [str(s) for s in loc if not (isinstance(s, str) and ("[" in s or s in ("str", "int", "float")))]
    return ".".join(steps) or str(loc[0])


def error_from_exception(error: BaseException, *, overload_status: int = 503) -> APIError:
    """The answer for an exception raised while serving a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, pydantic.ValidationError):
        return validation_error(error)
    if isinstance(error, QueueFull):
        return overloaded(overload_status, 1)
    if isinstance(error, EngineDeadError):  # raised while serving: admission answers 503 before this
        return APIError(500, f"The engine failed while serving this request: {error}")
    if isinstance(error, (ValueError, TypeError, OverflowError)):
        message = str(error)
        match = _LEADING_FIELD.match(message)
        param = match.group(1) if match and match.group(1) in _PARAM_NAMES else None
        return bad_request(message, param)
    if isinstance(error, NotImplementedError):
        return APIError(501, str(error) or "Not implemented.")
    return APIError(500, f"Internal server error ({type(error).__name__}).")

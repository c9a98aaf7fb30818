"""``ServerConfig``: the HTTP server's own settings (the engine's are ``AsyncLLM`` arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field

from oxibonsai.structured_output import REASONING_TOKENS

DEFAULT_MAX_BODY_BYTES = 32 << 20


@dataclass(frozen=True)
class ServerConfig:
    """``served_model_name``: the id clients send as ``model`` (the GGUF's name by default).
        ``api_keys``: any of them opens every route except ``/health`` and ``/ready`` (none: no auth).
        ``max_body_bytes``: larger request bodies get 413. ``allowed_origins``: CORS origins (none: no CORS
        headers). ``force_include_usage``: every stream ends with a usage chunk, asked for or not.
        ``overload_status``: 503 (default) or 429 when the waiting queue is full. ``shutdown_timeout``:
        seconds a SIGTERM waits for running requests before aborting them. ``sse_keepalive_s``: a stream
        idle this long (a long prefill, a long queue) sends an SSE comment, so proxies keep it open (0:
        never). ``reasoning_parser``: ``"qwen3"`` splits an output's ``<think>`` block into the chat
    message's ``reasoning_content`` (None: it stays in ``content``). ``prefix_cache_file``: the prefix
    cache is loaded from this file at startup and saved to it at shutdown (None: not kept)."""

    served_model_name: str = "default"
    model_path: str | None = None
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_origins: tuple[str, ...] = field(default=())
    force_include_usage: bool = False
    overload_status: int = 503
    retry_after_s: int = 1
    shutdown_timeout: float = 30.0
    sse_keepalive_s: float = 15.0
    reasoning_parser: str | None = None
    prefix_cache_file: str | None = None

    def __post_init__(self) -> None:
        if self.overload_status not in (429, 503):
            raise ValueError(f"overload_status must be 429 or 503, got {self.overload_status}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.sse_keepalive_s < 0:
            raise ValueError(f"sse_keepalive_s must be >= 0, got {self.sse_keepalive_s}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_TOKENS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_TOKENS)} or None")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")

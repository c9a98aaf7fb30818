"""The HTTP plumbing under the routes: bodies read with a size limit and parsed by the protocol models,
non-streaming work cancelled when its client disconnects, SSE responses that always close their body
and release their request, and the outermost middleware (API key for all but the probes, per-route
HTTP metrics). Knows nothing of the engine beyond ``ServerState``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oxibonsai.server.errors import APIError
from oxibonsai.server.serving_messages import anthropic_error
from oxibonsai.server.state import ServerState

#: Paths any client may call without an API key (probes).
PUBLIC_PATHS = frozenset({"/health", "/ready"})
#: Handler labels of the HTTP metrics; anything else is counted as "other".
ROUTES = (
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/embeddings", "/v1/models", "/tokenize", "/detokenize", "/health", "/ready", "/metrics", "/version",
)  # fmt: skip

ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic's routes, answered in Anthropic's error envelope

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` (from Content-Length or counted)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The request body is larger than {limit} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"The request body is larger than {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(request: Request, model: type[ModelT], limit: int) -> ModelT:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(400, f"Content-Type must be application/json, got {ctype!r}.")
    return model.model_validate_json(await read_body(request, limit))


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """Runs ``work`` unless the client disconnects first, in which case it is cancelled (aborting its
    engine requests). Returns None when cancelled."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """A text/event-stream whose body generator is always closed and whose ``on_close`` always runs,
    however the stream ends (finished, client gone, cancelled)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self._body, "aclose", None)
            if close is not None:
                await close()
            await self._on_close()


class GuardMiddleware:
    """Outermost layer: HTTP metrics for every request, then the API key for all but the probes."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_status)
            else:
                error = APIError(401, "Invalid or missing API key.", type="authentication_error")
                # Anthropic's clients read their own envelope ({"type": "error", "error": {...}}).
                body = anthropic_error(error) if scope["path"].startswith(ANTHROPIC_PREFIX) else error.body()
                await JSONResponse(body, status_code=401, headers=error.headers)(scope, receive, send_status)
        finally:
            path = scope["path"] if scope["path"] in ROUTES else "other"
            self.state.http.observe(path, scope["method"], status[0], time.perf_counter() - start)

    def _authorized(self, scope: Scope) -> bool:
        if scope["method"] == "OPTIONS" or scope["path"] in PUBLIC_PATHS:
            return True
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key")
        return self.state.key_ok(key)

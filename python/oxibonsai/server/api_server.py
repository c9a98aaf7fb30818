"""The FastAPI app: routes, auth, body limits, HTTP metrics and the engine's lifecycle. Routes only parse,
check and hand over: ``serving_completion`` / ``serving_chat`` do the translation.

Every error is OpenAI's envelope (``errors``), never FastAPI's 422: bodies are parsed by the protocol
models, and each route turns exceptions into answers in one place (``_answer``). A generation request is
admitted (tokenized, checked, submitted) before any response byte is sent, so a full queue is a clean
503 with ``Retry-After``. A non-streaming request whose client disconnects is cancelled, and a stream
whose client leaves is closed; both abort their engine requests, which frees their KV blocks.
The HTTP plumbing (body limits, disconnects, SSE, auth and metrics middleware) is in ``http``; what the
routes and the launcher share (engine, draining, requests in flight) in ``state``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.server.anthropic_protocol import MessagesRequest
from oxibonsai.server.beam_samples import BeamSamples
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.errors import APIError, error_from_exception, not_found_model
from oxibonsai.server.generation import Samples
from oxibonsai.server.http import GuardMiddleware, SSEResponse, cancel_on_disconnect, error_response, parse
from oxibonsai.server.metrics import vllm_aliases
from oxibonsai.server.prefix_cache_file import save_cache
from oxibonsai.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from oxibonsai.server.responses_protocol import ResponsesRequest
from oxibonsai.server.serving_chat import render_chat
from oxibonsai.server.serving_messages import anthropic_error
from oxibonsai.server.state import ServerState

log = logging.getLogger("oxibonsai.server")

EngineSource = AsyncLLM | Callable[[], AsyncLLM]


def package_version() -> str:
    try:
        return importlib.metadata.version("oxibonsai")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def _answer(
    call: Callable[[], Awaitable[Response]], state: ServerState, *, anthropic: bool = False
) -> Response:
    """Runs a route; any exception becomes an error answer, in OpenAI's envelope or, for Anthropic's
    routes, in Anthropic's (500s are logged, not exposed)."""
    try:
        return await call()
    except Exception as exc:
        error = error_from_exception(exc, overload_status=state.config.overload_status)
        if error.status >= 500 and not isinstance(exc, APIError):
            log.exception("request failed")
        if anthropic:
            return JSONResponse(anthropic_error(error), status_code=error.status, headers=error.headers)
        return error_response(error)


def build_app(engine: EngineSource, config: ServerConfig | None = None) -> FastAPI:
    """The app over ``engine``: an ``AsyncLLM`` (owned by the caller) or a factory that the app calls
    at startup, in a worker thread, and shuts down at exit."""
    config = config or ServerConfig()
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # uvicorn binds its socket only after startup: load in the background, so probes get a 503
        # ("loading") rather than a refused connection while a big model loads.
        loading = None if isinstance(engine, AsyncLLM) else asyncio.ensure_future(state.load(engine))
        try:
            yield
        finally:
            if loading is not None:
                await asyncio.shield(loading)  # a load in a thread cannot be cancelled
                if state.engine is not None:
                    if config.prefix_cache_file is not None:
                        await asyncio.to_thread(save_cache, state.engine, config.prefix_cache_file)
                    state.engine.shutdown()

    app = FastAPI(title="oxibonsai", version=package_version(), lifespan=lifespan)
    app.state.server = state
    if isinstance(engine, AsyncLLM):
        state.attach(engine)  # usable without running the lifespan (in-process tests)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    _add_probe_routes(app, state)
    _add_generation_routes(app, state)
    _add_tokenizer_routes(app, state)
    return app


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.config.served_model_name:
        raise not_found_model(model)


def _add_probe_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        engine = state.engine
        if engine is None:
            failed = "failed to load" if state.load_error is not None else "is loading"
            return error_response(APIError(503, f"The model {failed}."))
        if not engine.is_running:
            return error_response(APIError(503, "The engine is not running."))
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        return await _answer(lambda: _ready(state), state)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": package_version()})

    @app.get("/v1/models")
    async def models() -> Response:
        engine = state.engine
        if engine is None:  # clients (and benchmark tools) poll this to know the server is up
            return error_response(APIError(503, "The model is loading."))
        card = {
            "id": state.config.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "oxibonsai",
            "root": state.config.model_path,
            "parent": None,
            "max_model_len": engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return await _answer(lambda: _metrics(state), state)


async def _ready(state: ServerState) -> Response:
    state.live_engine()
    return JSONResponse({"status": "ready"})


async def _metrics(state: ServerState) -> Response:
    text = state.http.to_prometheus()
    engine = state.engine
    if engine is not None and hasattr(engine, "metrics_text"):  # replicas behind Ray Serve: their own
        text = await asyncio.to_thread(engine.metrics_text) + text
    elif engine is not None:
        # These take the engine's lock, which a step holds: read them off the event loop.
        snapshot, cache, ours = await asyncio.to_thread(
            lambda: (engine.metrics(), engine.cache_stats(), engine.prometheus_metrics())
        )
        text = ours + vllm_aliases(snapshot, cache, state.config.served_model_name, engine.block_size) + text
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    async def generation(
        request: Request, model: type[Any], serving: Callable[[], Any], anthropic: bool = False
    ) -> Response:
        async def run() -> Response:
            req = await parse(request, model, state.config.max_body_bytes)
            check_model(state, req.model)
            state.live_engine()
            return await _generate(request, state, serving(), req)

        return await _answer(run, state, anthropic=anthropic)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, CompletionRequest, lambda: state.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, ChatCompletionRequest, lambda: state.chat)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generation(request, ResponsesRequest, lambda: state.responses)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _json_route(
            request, state, EmbeddingRequest, lambda req: _live(state.embeddings).respond(req)
        )

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await generation(request, MessagesRequest, lambda: state.messages, anthropic=True)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        async def count(req: MessagesRequest) -> dict[str, Any]:
            return await _live(state.messages).count_tokens(req)

        return await _json_route(request, state, MessagesRequest, count, anthropic=True)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return await _answer(lambda: _stored_response(state, response_id, delete=False), state)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return await _answer(lambda: _stored_response(state, response_id, delete=True), state)


async def _stored_response(state: ServerState, response_id: str, *, delete: bool) -> Response:
    state.live_engine()
    serving = _live(state.responses)
    return JSONResponse(serving.delete(response_id) if delete else serving.get(response_id))


ServingT = TypeVar("ServingT")


def _live(serving: ServingT | None) -> ServingT:
    """A serving of the attached engine (routes check the engine is live first)."""
    assert serving is not None, "a live engine has its servings"
    return serving


async def _json_route(
    request: Request,
    state: ServerState,
    model: type[Any],
    respond: Callable[[Any], Awaitable[dict[str, Any]]],
    *,
    anthropic: bool = False,
) -> Response:
    """A route answering one JSON object: the body parsed as ``model``, the model name and the engine
    checked, then ``respond(request)``."""

    async def run() -> Response:
        req = await parse(request, model, state.config.max_body_bytes)
        check_model(state, req.model)
        state.live_engine()
        return JSONResponse(await respond(req))

    return await _answer(run, state, anthropic=anthropic)


async def _generate(request: Request, state: ServerState, serving: Any, req: Any) -> Response:
    """Admits the request (errors before any byte is sent), then streams or answers in full."""
    state.in_flight += 1
    released = False

    async def release(samples: Samples | BeamSamples | None = None) -> None:
        nonlocal released
        if samples is not None:
            await samples.aclose()
        if not released:
            released = True
            state.in_flight -= 1

    try:
        samples: Samples | BeamSamples = await serving.start(req)
    except BaseException:
        await release()
        raise
    if req.stream:
        return SSEResponse(serving.stream(req, samples), lambda: release(samples))
    try:
        body = await cancel_on_disconnect(request, serving.full_response(req, samples))
    finally:
        await release(samples)
    if body is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return Response(json.dumps(body, ensure_ascii=False).encode(), media_type="application/json")


def _add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        async def run() -> Response:
            req = await parse(request, TokenizeRequest, state.config.max_body_bytes)
            check_model(state, req.model)
            engine = state.live_engine()
            ids = await asyncio.to_thread(_tokenize, engine, req)
            return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

        return await _answer(run, state)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def run() -> Response:
            req = await parse(request, DetokenizeRequest, state.config.max_body_bytes)
            check_model(state, req.model)
            engine = state.live_engine()
            vocab = engine.tokenizer.vocab_size
            bad = next((t for t in req.tokens if t >= vocab), None)
            if bad is not None:
                raise APIError(
                    400, f"token id {bad} is out of range for a vocabulary of {vocab}", param="tokens"
                )
            return JSONResponse({"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)})

        return await _answer(run, state)


def _tokenize(engine: AsyncLLM, req: TokenizeRequest) -> list[int]:
    if req.prompt is not None:
        return engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [m.model_dump(exclude_none=True) for m in req.messages or []],
            "tools": [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
            "chat_template_kwargs": req.chat_template_kwargs,
        },
        strict=False,
    )
    return render_chat(engine, chat).token_ids

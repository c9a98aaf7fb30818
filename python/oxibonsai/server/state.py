"""``ServerState``: what the routes and the launcher share about one server: the engine (None while it
loads), the serving objects, requests in flight, whether it is draining, the HTTP metrics and the API
keys (kept as SHA-256 digests and compared in constant time)."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import secrets
from collections.abc import Callable

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.errors import APIError
from oxibonsai.server.metrics import HttpMetrics
from oxibonsai.server.prefix_cache_file import load_saved_cache
from oxibonsai.server.serving_chat import ChatServing
from oxibonsai.server.serving_completion import CompletionServing
from oxibonsai.server.serving_embeddings import EmbeddingServing
from oxibonsai.server.serving_messages import MessagesServing
from oxibonsai.server.serving_responses import ResponsesServing

log = logging.getLogger("oxibonsai.server")


class ServerState:
    """The engine, the config and what the lifecycle needs: requests in flight, draining, loading."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: AsyncLLM | None = None
        self.load_error: Exception | None = None
        self.draining = False
        self.in_flight = 0
        self.http = HttpMetrics()
        self.completion: CompletionServing | None = None
        self.chat: ChatServing | None = None
        self.responses: ResponsesServing | None = None
        self.messages: MessagesServing | None = None
        self.embeddings: EmbeddingServing | None = None
        self._key_digests = [hashlib.sha256(k.encode()).digest() for k in config.api_keys]

    async def load(self, factory: Callable[[], AsyncLLM]) -> None:
        """Builds the engine in a worker thread, with the saved prefix cache where one is configured; a
        failure is kept in ``load_error`` (the launcher exits on it) and every route keeps answering
        503."""
        try:
            engine = await asyncio.to_thread(factory)
        except Exception as error:
            log.error("the model failed to load: %s", error)
            self.load_error = error
            return
        if self.config.prefix_cache_file is not None:
            try:
                await asyncio.to_thread(load_saved_cache, engine, self.config.prefix_cache_file)
            except Exception:  # a bug here must not keep the server from serving
                log.exception("loading the prefix-cache file failed")
        self.attach(engine)

    def attach(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.completion = CompletionServing(engine, self.config)
        self.chat = ChatServing(engine, self.config)
        self.responses = ResponsesServing(engine, self.config, self.chat)
        self.messages = MessagesServing(engine, self.config, self.chat)
        self.embeddings = EmbeddingServing(engine, self.config)

    def live_engine(self) -> AsyncLLM:
        """The engine, or 503 while loading, after a failure or while draining."""
        if self.load_error is not None:
            raise APIError(503, "The model failed to load.")
        if self.engine is None:
            raise APIError(503, "The model is loading.")
        if not self.engine.is_running:
            raise APIError(503, "The engine is not running (it failed or is shutting down).")
        if self.draining:
            raise APIError(503, "The server is shutting down and takes no new requests.")
        return self.engine

    def key_ok(self, key: str | None) -> bool:
        if not self._key_digests:
            return True
        if key is None:
            return False
        digest = hashlib.sha256(key.encode()).digest()
        # Every key is compared, in constant time, so the answer's timing says nothing about which.
        return sum(secrets.compare_digest(digest, d) for d in self._key_digests) > 0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

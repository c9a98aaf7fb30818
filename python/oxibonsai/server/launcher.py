"""``oxibonsai serve``: the engine and server flags (spelled as vLLM's), and uvicorn with our lifecycle.

``DrainingServer`` changes what SIGTERM/SIGINT do (``drain()`` does the same from code): the first
stops admitting (``/ready`` and new generation requests answer 503) and waits up to
``--shutdown-timeout`` seconds for the requests in flight, then aborts the rest (their streams end with
``finish_reason: "abort"``) and lets uvicorn shut down; a second signal exits at once. A watchdog ends
the process (exit status 1) when the engine's step loop has failed, unless
``--keep-alive-on-engine-death``: ``/health`` answers 503 meanwhile. uvicorn's h11 limits bound
header sizes (CVE-2025-48956's class of attack)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from types import FrameType

import uvicorn

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.llm import default_model_path
from oxibonsai.runner import choose
from oxibonsai.server.api_server import build_app
from oxibonsai.server.cli_args import engine_args
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.state import ServerState, is_loopback

log = logging.getLogger("oxibonsai.server")

# A request head (line and headers) larger than this is refused; h11 always (httptools has no limit).
H11_MAX_INCOMPLETE_EVENT_BYTES = 64 << 10
DRAIN_POLL_S = 0.05
ABORT_FLUSH_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn with a draining first signal and an engine watchdog (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, keep_alive_on_engine_death: bool) -> None:
        super().__init__(config)
        self.state = state
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        self.engine_died = False
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None

    def drain(self) -> None:
        """Starts the graceful shutdown a first SIGTERM starts; safe to call from any thread. The
        server stops admitting at once and its loop begins waiting for the requests within a tick."""
        self.state.draining = True
        self._drain_requested = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or self.state.engine is None:
            super().handle_exit(sig, frame)  # a second signal, or nothing to drain: uvicorn's own exit
            return
        timeout = self.state.config.shutdown_timeout
        log.info("signal %d: draining (up to %.0fs), no new requests", sig, timeout)
        self.drain()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.config.shutdown_timeout
        while self.state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.state.in_flight and self.state.engine is not None:
            log.info("drain timeout: aborting %d requests", self.state.in_flight)
            await asyncio.to_thread(self.state.engine.shutdown)  # waits for the running step
            flush_deadline = time.monotonic() + ABORT_FLUSH_S
            while self.state.in_flight and time.monotonic() < flush_deadline:
                await asyncio.sleep(DRAIN_POLL_S)
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        if self.state.load_error is not None and not self.engine_died:
            self.engine_died = True  # nothing to serve: exit 1
            self.should_exit = True
        engine = self.state.engine
        if engine is not None and not engine.is_running and not self.state.draining and not self.engine_died:
            self.engine_died = True
            log.error("the engine's step loop stopped; /health answers 503")
            if not self.keep_alive_on_engine_death:
                self.should_exit = True
        return await super().on_tick(counter)


def server_config(args: argparse.Namespace, model_path: str, name: str) -> ServerConfig:
    keys = list(args.api_key or [])
    if not keys and os.environ.get("OXIBONSAI_API_KEY"):
        keys = [os.environ["OXIBONSAI_API_KEY"]]
    return ServerConfig(
        served_model_name=name,
        model_path=model_path,
        api_keys=tuple(keys),
        max_body_bytes=args.max_body_bytes,
        allowed_origins=tuple(args.allowed_origins or ()),
        force_include_usage=args.enable_force_include_usage,
        overload_status=args.overload_status,
        shutdown_timeout=args.shutdown_timeout,
        sse_keepalive_s=args.sse_keepalive_interval,
        reasoning_parser=args.reasoning_parser,
        prefix_cache_file=args.prefix_cache_file,
    )


def serve(args: argparse.Namespace) -> int:
    """Runs the server until a signal; the exit status (0 after a drain, 1 if it could not start or
    the engine died)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model_path = str(args.model) if args.model is not None else str(default_model_path())
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"no such model file: {model_path}")
    kwargs = engine_args(args)
    choose(args.device, args.runner)  # an impossible device fails here, not in the background load
    default_name = os.path.splitext(os.path.basename(model_path))[0]
    config = server_config(args, model_path, args.served_model_name or _gguf_name(model_path) or default_name)
    if not is_loopback(args.host) and not config.api_keys:
        log.warning(
            "binding %s without --api-key: anyone who can reach this port can use the model", args.host
        )
    _log_sampling_defaults(model_path, args.generation_config)
    if args.replicas > 1 or args.ray_address is not None:
        from oxibonsai.server.scale_out.app import serve_ray

        return serve_ray(args, config, kwargs)
    app = build_app(lambda: AsyncLLM(model_path, **kwargs), config)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.disable_uvicorn_access_log,
        http="h11",
        h11_max_incomplete_event_size=H11_MAX_INCOMPLETE_EVENT_BYTES,
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(uv_config, app.state.server, args.keep_alive_on_engine_death)
    server.run()
    if not server.started:
        return 1
    return 1 if server.engine_died else 0


def _log_sampling_defaults(path: str, generation_config: str) -> None:
    """Says which sampling fields a request that leaves them out gets from the GGUF (as vLLM says
    its generation config overrides its defaults)."""
    from oxibonsai import GGUFFile
    from oxibonsai.generation_config import model_sampling_defaults

    defaults = model_sampling_defaults(GGUFFile(path).metadata, generation_config)
    if defaults:
        log.info(
            "requests that leave them out sample with the model's %s (--generation-config vllm: not)",
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )


def _gguf_name(path: str) -> str | None:
    from oxibonsai import GGUFFile

    name = GGUFFile(path).metadata.get("general.name")
    return name if isinstance(name, str) and name else None

"""Helpers for the server tests: an in-process client over the ASGI app, a real uvicorn server on a
free loopback port in a background thread, SSE parsing, and the engine's block accounting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import uvicorn

import oxibonsai as ob
from oxibonsai.server import ServerConfig, build_app

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def asgi_client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver", timeout=60)


def post(app: Any, path: str, body: dict[str, Any]) -> Any:
    """One JSON POST to the in-process app; the response."""

    async def go() -> Any:
        async with asgi_client(app) as c:
            return await c.post(path, json=body)

    return run(go())


def app_for(engine: ob.AsyncLLM, **config: Any) -> Any:
    config.setdefault("served_model_name", "bonsai")
    return build_app(engine, ServerConfig(**config))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def live_server(app: Any) -> Iterator[str]:
    """uvicorn serving ``app`` on 127.0.0.1 in a thread; yields the base URL; stops it on exit."""
    with threaded_server(app, uvicorn.Server) as (url, _):
        yield url


@contextlib.contextmanager
def threaded_server(
    app: Any, make_server: Callable[[uvicorn.Config], uvicorn.Server], lifespan: str = "off"
) -> Iterator[tuple[str, uvicorn.Server]]:
    """``make_server(config)`` serving ``app`` in a thread; yields (base URL, server); stops it on exit.
    ``lifespan="on"`` runs the app's startup and shutdown (an engine factory is loaded and shut down)."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan)
    server = make_server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def slow_steps(engine: ob.AsyncLLM, seconds: float) -> None:
    """Every engine step takes at least ``seconds`` longer, so a test's requests are surely still
    running when it looks, on however fast a machine."""
    step = engine._engine.step

    def slow() -> Any:
        out = step()
        time.sleep(seconds)
        return out

    engine._engine.step = slow  # type: ignore[method-assign]


def sse_payloads(text: str) -> list[Any]:
    """The JSON objects of an SSE body, then the string ``"[DONE]"`` if it ended with it (comments,
    the keep-alives, are skipped as SSE clients skip them)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block or block.startswith(":"):
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def blocks_held(engine: ob.AsyncLLM) -> int:
    """KV blocks some request still references (neither free nor idle in the prefix cache)."""
    s = engine.cache_stats()
    return int(s["capacity_blocks"] - s["free_blocks"] - s["idle_blocks"])


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def engine_idle(engine: ob.AsyncLLM) -> bool:
    m = engine.metrics()
    return m["num_running"] == 0 and m["num_waiting"] == 0 and blocks_held(engine) == 0


@contextlib.contextmanager
def server_process(
    *flags: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m oxibonsai serve`` on a free loopback port; yields (base URL, process) once /health
    answers; kills it on exit if it is still running."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "oxibonsai",
        "serve",
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
        *flags,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                raise RuntimeError(f"the server exited with {proc.returncode}: {out[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not answer /health within 60 s")
            time.sleep(0.05)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()


def typed_events(text: str) -> list[Any]:
    """The JSON objects of an SSE body whose events are named (``event: X`` then ``data:``, as the
    Responses and Messages APIs stream), after checking each name is its payload's ``type``."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append(json.loads(data[len("data: ") :]))
        assert events[-1]["type"] == name[len("event: ") :]
    return events

"""The server under load and faults: a full queue answers 503 + Retry-After before any byte; clients
that disconnect (streaming or not, running or queued) free every KV block; an engine failure becomes
500s and a 503 /health, never a hang; 64 concurrent streams give the tokens each gives alone; a seeded
request gives the same output whatever else runs. Real-socket tests run uvicorn in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from typing import Any

import httpx
import pytest
import uvicorn

import oxibonsai as ob

from server_support import (
    app_for,
    asgi_client,
    blocks_held,
    engine_idle,
    live_server,
    run,
    slow_steps,
    sse_payloads,
    threaded_server,
    wait_until,
)

pytest.importorskip("fastapi")


def words(rng: random.Random, n: int) -> str:
    pool = ["the", "module", "returns", "a", "list", "of", "files", "in", "path", "os", "data", "string"]
    return " ".join(rng.choice(pool) for _ in range(n))


def long_request(stream: bool = False) -> dict[str, Any]:
    return {"prompt": "os", "max_tokens": LONG, "ignore_eos": True, "stream": stream}


LONG = 200  # tokens; with slow_steps, seconds of work whatever the machine


@pytest.mark.parametrize("status", [503, 429])
def test_a_full_queue_is_refused_with_retry_after_before_any_byte(status: int) -> None:
    """One request running, one waiting (max_waiting=1): the next, streamed or not, gets the
    configured overload status (503 by default, 429 by choice) as JSON, and the two admitted finish."""
    engine = ob.AsyncLLM(None, max_num_seqs=1, max_waiting=1)
    slow_steps(engine, 0.005)
    app = app_for(engine, overload_status=status)

    async def go() -> None:
        async with asgi_client(app) as c:
            running = asyncio.ensure_future(c.post("/v1/completions", json=long_request()))
            assert await asyncio.to_thread(wait_until, lambda: engine.metrics()["num_running"] == 1)
            waiting = asyncio.ensure_future(c.post("/v1/completions", json=long_request()))
            assert await asyncio.to_thread(wait_until, lambda: engine.metrics()["num_waiting"] == 1)
            for stream in (False, True):
                r = await c.post("/v1/completions", json=long_request(stream))
                assert r.status_code == status, r.text
                assert r.headers["retry-after"] == "1"
                assert r.headers["content-type"].startswith("application/json")
                assert r.json()["error"]["code"] == status
            assert (await c.get("/health")).status_code == 200
            for task in (running, waiting):
                assert (await task).json()["usage"]["completion_tokens"] == LONG

    try:
        run(go())
        assert wait_until(lambda: engine_idle(engine))
    finally:
        engine.shutdown()


def test_engine_failure_is_500_for_waiters_and_503_health() -> None:
    """Two requests are admitted (one plain, one streaming), then the next step fails."""
    engine = ob.AsyncLLM(None, max_num_seqs=1)
    app = app_for(engine)
    real_step = engine._engine.step
    fail = threading.Event()

    def failing_step() -> Any:
        if fail.is_set():
            raise RuntimeError("injected step failure")
        return real_step()

    engine._engine.step = failing_step  # type: ignore[method-assign]

    async def go() -> None:
        async with asgi_client(app) as c:
            plain = asyncio.ensure_future(c.post("/v1/completions", json=long_request()))
            streamed = asyncio.ensure_future(c.post("/v1/completions", json=long_request(stream=True)))
            admitted = lambda: sum(engine.metrics()[k] for k in ("num_running", "num_waiting")) == 2  # noqa: E731
            assert await asyncio.to_thread(wait_until, admitted)
            fail.set()
            r = await asyncio.wait_for(plain, 30)
            assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
            events = sse_payloads((await asyncio.wait_for(streamed, 30)).text)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
            assert (await c.get("/health")).status_code == 503
            assert (await c.get("/ready")).status_code == 503
            after = await c.post("/v1/completions", json={"prompt": "os"})
            assert after.status_code == 503

    try:
        run(go())
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def served() -> Any:
    engine = ob.AsyncLLM(None, max_num_seqs=8, seed=random.randrange(2**32))
    with live_server(app_for(engine)) as url:
        yield engine, url
    engine.shutdown()


async def read_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], stop_after: int | None
) -> Any:
    """The stream's text and finish reason, or None when it was left after ``stop_after`` events."""
    text, finish, seen = "", None, 0
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        if stop_after == 0:  # admitted, maybe still queued: leave before the first event
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            seen += 1
            if stop_after is not None and seen >= stop_after:
                return None
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


def test_64_concurrent_streams_give_the_tokens_each_gives_alone(served: Any) -> None:
    engine, url = served
    rng = random.Random()
    bodies = [
        {"prompt": words(rng, rng.randrange(2, 30)), "max_tokens": rng.randrange(8, 32), "temperature": 0}
        for _ in range(64)
    ]

    async def go() -> tuple[list[Any], list[Any]]:
        async with httpx.AsyncClient(timeout=120) as c:
            alone = [await read_stream(c, url, b, None) for b in bodies]
            together = await asyncio.gather(*(read_stream(c, url, b, None) for b in bodies))
        return alone, list(together)

    alone, together = run(go())
    assert together == alone
    assert all(finish in ("stop", "length") for _, finish in alone)
    assert wait_until(lambda: engine_idle(engine))


def test_random_disconnects_leave_no_block_held(served: Any) -> None:
    """32 streams over 8 running slots: some leave while queued, some mid-stream, some finish."""
    engine, url = served
    rng = random.Random()

    async def go() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            jobs = []
            for _ in range(32):
                body = {"prompt": words(rng, rng.randrange(2, 60)), "max_tokens": 64, "ignore_eos": True}
                jobs.append(read_stream(c, url, body, rng.choice([None, 0, 1, 2, 5, 20])))
            await asyncio.gather(*jobs)

    run(go())
    assert wait_until(lambda: engine_idle(engine)), (blocks_held(engine), engine.metrics()["num_running"])


def test_non_streaming_clients_that_time_out_are_cancelled() -> None:
    """vLLM's request-cancellation test: clients give up on long non-streaming requests; the engine
    drops them and the next request is served."""
    engine = ob.AsyncLLM(None, max_num_seqs=4)
    slow_steps(engine, 0.005)

    async def go(url: str) -> None:
        async with httpx.AsyncClient() as c:
            for _ in range(12):
                with pytest.raises(httpx.TimeoutException):
                    await c.post(url + "/v1/completions", json=long_request(), timeout=0.05)
        assert await asyncio.to_thread(wait_until, lambda: engine_idle(engine))
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(url + "/v1/completions", json={"prompt": "os", "max_tokens": 4})
            assert r.status_code == 200

    try:
        with live_server(app_for(engine)) as url:
            run(go(url))
        counters = engine.metrics()["counters"]
        assert counters["generation_tokens_total"] < 12 * LONG // 2, "abandoned requests kept running"
        assert counters["requests_finished"]["length"] == 1
    finally:
        engine.shutdown()


def test_a_seeded_request_is_the_same_whatever_else_runs(served: Any) -> None:
    _, url = served
    rng = random.Random()
    seeded = {
        "prompt": words(rng, 8),
        "max_tokens": 24,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": rng.randrange(2**62),
    }
    noise = [
        {"prompt": words(rng, rng.randrange(2, 40)), "max_tokens": rng.randrange(4, 40)} for _ in range(12)
    ]

    async def go() -> tuple[Any, Any]:
        async with httpx.AsyncClient(timeout=120) as c:
            alone = (await c.post(url + "/v1/completions", json=seeded)).json()
            results = await asyncio.gather(
                *(c.post(url + "/v1/completions", json=b) for b in noise[:6]),
                c.post(url + "/v1/completions", json=seeded),
                *(c.post(url + "/v1/completions", json=b) for b in noise[6:]),
            )
        return alone, results[6].json()

    alone, busy = run(go())
    assert busy["choices"][0]["text"] == alone["choices"][0]["text"]


def test_drain_with_zero_timeout_aborts_running_requests() -> None:
    """What SIGTERM with --shutdown-timeout 0 does (``DrainingServer.drain``, a real uvicorn server):
    streams in flight end with finish_reason "abort", and the server stops."""
    from oxibonsai.server.launcher import DrainingServer

    engine = ob.AsyncLLM(None, max_num_seqs=2)
    slow_steps(engine, 0.005)
    app = app_for(engine, shutdown_timeout=0)
    holder: dict[str, DrainingServer] = {}

    def make(config: Any) -> DrainingServer:
        holder["server"] = DrainingServer(config, app.state.server, keep_alive_on_engine_death=False)
        return holder["server"]

    async def finish_reason(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> str | None:
        reason = None
        async with client.stream("POST", url + "/v1/completions", json=long_request(stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    started.set()
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
        return reason

    async def go(url: str) -> list[str | None]:
        async with httpx.AsyncClient(timeout=60) as c:
            flags = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.ensure_future(finish_reason(c, url, f)) for f in flags]
            for f in flags:
                await asyncio.wait_for(f.wait(), 30)
            holder["server"].drain()
            return list(await asyncio.gather(*streams))

    try:
        with threaded_server(app, make) as (url, server):
            assert run(go(url)) == ["abort", "abort"]
            assert wait_until(lambda: server.should_exit)
    finally:
        engine.shutdown()


def test_probes_answer_503_while_the_model_loads_then_200() -> None:
    """The socket is bound before the model is loaded: a probe gets 503 ("loading"), not a refused
    connection; the app owns an engine it built and shuts it down at exit."""
    from oxibonsai.server import ServerConfig, build_app

    loaded = threading.Event()
    built: list[ob.AsyncLLM] = []

    def factory() -> ob.AsyncLLM:
        loaded.wait(30)
        built.append(ob.AsyncLLM(None))
        return built[0]

    app = build_app(factory, ServerConfig(served_model_name="bonsai"))
    with threaded_server(app, uvicorn.Server, lifespan="on") as (url, _):
        for path in ("/health", "/ready", "/v1/models"):
            r = httpx.get(url + path, timeout=5)
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        busy = httpx.post(url + "/v1/completions", json={"prompt": "os"}, timeout=5)
        assert busy.status_code == 503
        loaded.set()
        assert wait_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200)
        assert (
            httpx.post(
                url + "/v1/completions", json={"prompt": "os", "max_tokens": 2}, timeout=30
            ).status_code
            == 200
        )
    assert not built[0].is_running, "the app shuts down the engine it built"


def test_a_failed_load_is_503_and_stops_the_server() -> None:
    from oxibonsai.server import ServerConfig, build_app
    from oxibonsai.server.launcher import DrainingServer

    def factory() -> ob.AsyncLLM:
        raise ob.GGUFError("tensor blk.0.attn_q.weight: truncated data")

    app = build_app(factory, ServerConfig())

    def make(config: Any) -> DrainingServer:
        return DrainingServer(config, app.state.server, keep_alive_on_engine_death=True)

    with threaded_server(app, make, lifespan="on") as (url, server):
        assert wait_until(lambda: app.state.server.load_error is not None)
        with contextlib.suppress(httpx.HTTPError):  # it may already be closing
            r = httpx.get(url + "/health", timeout=5)
            assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
        assert wait_until(lambda: server.should_exit)
        assert server.engine_died  # serve() turns this into exit status 1


def test_an_idle_stream_sends_keep_alive_comments() -> None:
    """Steps slower than the keep-alive interval: the stream carries SSE comments between chunks, and
    its data events are what they would be without them."""
    engine = ob.AsyncLLM(None)
    slow_steps(engine, 0.05)
    body = {"prompt": "os", "max_tokens": 4, "temperature": 0, "stream": True}

    async def stream(keepalive: float) -> str:
        async with asgi_client(app_for(engine, sse_keepalive_s=keepalive)) as c:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200
            return r.text

    try:
        with_pings, without = run(stream(0.01)), run(stream(0))
        assert ": keep-alive\n\n" in with_pings and ": keep-alive" not in without
        texts = [[e["choices"][0]["text"] for e in sse_payloads(t)[:-1]] for t in (with_pings, without)]
        assert texts[0] == texts[1] and sse_payloads(with_pings)[-1] == "[DONE]"
    finally:
        engine.shutdown()

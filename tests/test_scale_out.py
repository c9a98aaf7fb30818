"""The Ray Serve app end to end on one machine: one local Ray instance for the module, two engine
replicas with one kernel thread each, HTTP on a free loopback port. The OpenAI routes give the single
server's tokens; prefix routing keeps the cluster's prefix hit rate at a single replica's and clearly
above Serve's power-of-two routing in the same run; a full cluster answers 503 with Retry-After; a
replica killed under load fails its own requests (never hangs them), the rest finish, and Serve's
replacement takes traffic."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'oxibonsai[ray]')")
from ray import serve  # noqa: E402
from ray.serve.config import HTTPOptions  # noqa: E402

import oxibonsai as ob  # noqa: E402
from oxibonsai.server import ServerConfig, build_app  # noqa: E402
from oxibonsai.server.scale_out.app import build_ray_app  # noqa: E402
from oxibonsai.server.scale_out.board import board_name  # noqa: E402
from oxibonsai.server.scale_out.replica import BOARD_NAMESPACE  # noqa: E402

from models import tiny_config, write_tiny  # noqa: E402
from server_support import asgi_client, free_port, run, sse_payloads, wait_until  # noqa: E402

NAME = "bonsai"
ENGINE = {"num_threads": 1, "max_model_len": 512, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray instance and Serve's HTTP proxy; yields the base URL."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(model: Path, routing: str, app: str, cache_file: str | None = None, **engine: Any) -> None:
    """Replaces whatever runs at "/" with a two-replica app and waits until it answers."""
    for name in serve.status().applications:
        serve.delete(name)
    config = ServerConfig(served_model_name=NAME, model_path=str(model), prefix_cache_file=cache_file)
    args = {**ENGINE, **engine}
    serve.run(
        build_ray_app(
            None if model is None else str(model), config, routing=routing, engine_args=args, app_name=app
        ),
        name=app,
        route_prefix="/",
    )


def board(app: str) -> dict[str, dict[str, Any]]:
    actor = ray.get_actor(board_name(app), namespace=BOARD_NAMESPACE)
    posts: dict[str, dict[str, Any]] = ray.get(actor.snapshot.remote())
    return posts


def hit_rate(app: str, replicas: int = 2) -> float:
    assert wait_until(lambda: len(board(app)) == replicas, 20)
    time.sleep(1.5)  # one more post from each replica, after the last request
    posts = board(app).values()
    queried = sum(p["cache"]["queried_tokens"] for p in posts)
    return sum(p["cache"]["hit_tokens"] for p in posts) / queried


def complete(url: str, prompt: Any, **fields: Any) -> httpx.Response:
    body = {"model": NAME, "prompt": prompt, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_routes_give_the_single_servers_tokens(cluster, tiny_model, rng):
    deploy(tiny_model, "prefix", "same-tokens")
    single = ob.AsyncLLM(tiny_model, **ENGINE)
    prompts = ["the model", "a b c d e f"]
    seed = int(rng.integers(1 << 30))
    fields = [
        {"temperature": 0.0},
        {"temperature": 0.9, "seed": seed},
        {"temperature": 0.9, "seed": seed, "structured_outputs": {"regex": "[a-e]{2,9}"}},
    ]

    async def locally() -> list[Any]:
        async with asgi_client(build_app(single, ServerConfig(served_model_name=NAME))) as client:
            return [
                (
                    await client.post(
                        "/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 8, **f}
                    )
                ).json()
                for p in prompts
                for f in fields
            ]

    try:
        want = run(locally())
    finally:
        single.shutdown()
    got = [complete(cluster, p, max_tokens=8, **f).json() for p in prompts for f in fields]
    assert [g["choices"][0]["text"] for g in got] == [w["choices"][0]["text"] for w in want]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    response = httpx.post(f"{cluster}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["role"] == "assistant"
    # The Responses API runs on the ingress over the same replicas, and continues a stored response.
    first = httpx.post(
        f"{cluster}/v1/responses", json={"model": NAME, "input": "hi", "max_output_tokens": 6}, timeout=60
    )
    assert first.status_code == 200 and first.json()["output"][0]["type"] == "message", first.text
    then = {
        "model": NAME,
        "input": "more",
        "max_output_tokens": 4,
        "previous_response_id": first.json()["id"],
    }
    assert httpx.post(f"{cluster}/v1/responses", json=then, timeout=60).status_code == 200
    body = {"model": NAME, "prompt": "the", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as s:
        events = sse_payloads(s.read().decode())
    assert events[-1] == "[DONE]" and len(events) >= 3
    assert complete(cluster, "x", max_tokens=10_000).status_code == 400, "the context check is the server's"
    bad_grammar = complete(cluster, "x", structured_outputs={"regex": "(a"})
    assert bad_grammar.status_code == 400 and "invalid structured output" in bad_grammar.text
    # The ingress reads the replicas' posts once a second: wait until both show.
    assert wait_until(lambda: len(replica_labels(httpx.get(f"{cluster}/metrics", timeout=30).text)) == 2)
    metrics = httpx.get(f"{cluster}/metrics", timeout=30).text
    assert metrics.count("# TYPE vllm:prefix_cache_hits_total") == 1
    assert httpx.get(f"{cluster}/health", timeout=30).status_code == 200


def replica_labels(metrics: str) -> set[str]:
    return {line.split('replica="')[1].split('"')[0] for line in metrics.splitlines() if 'replica="' in line}


def prefix_workload(rng: np.random.Generator, vocab: int, groups: int, rounds: int) -> list[list[int]]:
    """``groups`` 64-token prefixes, each sent ``rounds`` times with its own 8-token tail, interleaved."""
    prefixes = [[int(t) for t in rng.integers(0, vocab, 64)] for _ in range(groups)]
    return [p + [int(t) for t in rng.integers(0, vocab, 8)] for _ in range(rounds) for p in prefixes]


def test_every_replica_starts_from_the_prefix_cache_file(cluster, tiny_model, rng, tmp_path):
    prompt = [int(t) for t in rng.integers(0, 300, int(rng.integers(40, 120)))]
    writer = ob.LLM(tiny_model, **ENGINE)
    writer.generate([prompt], ob.SamplingParams(max_tokens=1))
    writer.save_prefix_cache(tmp_path / "cache.bin")
    deploy(tiny_model, "pow2", "cache-file", cache_file=str(tmp_path / "cache.bin"))
    assert wait_until(lambda: httpx.get(f"{cluster}/ready", timeout=5).status_code == 200, 60)
    for _ in range(4):  # pow2 spreads them over both replicas
        answer = complete(cluster, prompt, max_tokens=2).json()
        assert "usage" in answer, answer
        usage = answer["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 16 * ((len(prompt) - 1) // 16)


def test_prefix_routing_keeps_a_single_replicas_hit_rate_and_beats_pow2(cluster, tiny_model, rng):
    llm = ob.LLM(tiny_model, **ENGINE)
    # pow2 sends a later round's prompt to its prefix's replica by chance (1/2, then 3/4): with 8 groups it
    # came within 0.08 of prefix routing in about one run of 50 (a CI run failed so, 0.593 vs 0.519);
    # with 16 its expected 0.37 sits about 2.6 standard deviations below that margin.
    prompts = prefix_workload(rng, llm.config["vocab"], groups=16, rounds=3)
    llm.generate(prompts, ob.SamplingParams(max_tokens=1), use_tqdm=False)
    single = llm.cache_stats()["hit_rate"]
    rates = {}
    for routing in ("prefix", "pow2"):
        deploy(tiny_model, routing, f"routing-{routing}")
        for prompt in prompts:  # one at a time: every replica's queue looks alike to the routers
            assert complete(cluster, prompt, max_tokens=1).status_code == 200
        rates[routing] = hit_rate(f"routing-{routing}")
    print(f"hit rates: single replica {single:.3f}, prefix {rates['prefix']:.3f}, pow2 {rates['pow2']:.3f}")
    assert rates["prefix"] >= single - 0.05
    assert rates["prefix"] >= rates["pow2"] + 0.08


def test_a_full_cluster_answers_503_with_retry_after(cluster, slow_model):
    # The slow model: requests must still run when the last of the flood arrives.
    deploy(slow_model, "prefix", "backpressure", max_num_seqs=1, max_waiting=1)

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster, timeout=120) as client:
            body = {"model": NAME, "prompt": "the", "max_tokens": 64, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))

    responses = run(flood())
    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 503]
    assert set(statuses) <= {200, 503} and 200 in statuses
    assert refused and all("Retry-After" in r.headers and r.json()["error"] for r in refused)


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    """Wide enough that a 400-token request takes seconds on one thread."""
    cfg = tiny_config(
        hidden_size=1024, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=128, ffn_size=3072
    )
    return write_tiny(tmp_path_factory.mktemp("models") / "slow.gguf", model_seed + 11, cfg=cfg)


async def busy_replica(app: str, tasks: list[asyncio.Future[Any]], timeout: float = 30.0) -> str:
    """The actor name of a replica whose last board post shows running requests, polled until one
    does (posts come once a second) while ``tasks`` are still in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(t.done() for t in tasks):
        busy = [p["actor_name"] for p in board(app).values() if p.get("num_running", 0) > 0]
        if busy:
            return busy[0]
        await asyncio.sleep(0.2)
    raise AssertionError("no replica reported running requests while they were in flight")


def test_a_killed_replica_fails_its_requests_the_rest_finish_and_it_comes_back(cluster, slow_model):
    app = "kill"
    deploy(slow_model, "pow2", app)
    assert wait_until(lambda: len(board(app)) == 2, 20)
    before = board(app)

    async def load() -> list[Any]:
        async with httpx.AsyncClient(base_url=cluster, timeout=120) as client:
            body = {"model": NAME, "prompt": "the", "max_tokens": 400, "ignore_eos": True}
            tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(8)]
            # The victim is a replica the board shows decoding (routing decides which got requests).
            victim = await busy_replica(app, tasks)
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90)

    results = run(load())
    statuses = [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in results]
    print("statuses after the kill:", statuses)
    assert all(s in (200, 500, 503) or s == "RemoteProtocolError" for s in statuses), statuses
    assert 200 in statuses, "the surviving replica's requests finish"
    assert any(s != 200 for s in statuses), "the killed replica's requests fail"
    # Serve replaces the replica; the newcomer takes traffic.
    assert wait_until(lambda: len(set(board(app)) - set(before)) == 1, 60), board(app).keys()
    new = (set(board(app)) - set(before)).pop()

    def newcomer_served() -> bool:
        # Requests one at a time until one reaches it: with both replicas idle, Serve's router may
        # pick the old one many times in a row (6 requests all went there in one CI run).
        assert complete(cluster, "the", max_tokens=2).status_code == 200
        return board(app)[new]["cache"]["queries"] > 0

    assert wait_until(newcomer_served, 30), "the new replica never got a request"

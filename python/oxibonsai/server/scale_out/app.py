"""``build_ray_app``: the Ray Serve application (an ingress serving the OpenAI routes, N engine
replicas behind a router), and ``serve_ray``, what ``oxibonsai serve --replicas N`` runs: it joins the
cluster at ``--ray-address`` or starts a local Ray instance (stopped again at exit), runs the app on
``--host``/``--port`` and waits for SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig

from oxibonsai import GGUFFile
from oxibonsai._core import gguf_rope_scaling
from oxibonsai.generation_config import model_sampling_defaults
from oxibonsai.llm import default_model_path
from oxibonsai.rope_scaling import RopeScaling
from oxibonsai.runner import BLOCK_TOKENS, DEFAULT_MAX_MODEL_LEN
from oxibonsai.server.api_server import build_app
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.scale_out.board import MetricsBoard, board_name
from oxibonsai.server.scale_out.remote import RemoteEngine
from oxibonsai.server.scale_out.replica import BOARD_NAMESPACE, EngineReplica
from oxibonsai.server.scale_out.router import PrefixAffinityRouter
from oxibonsai.tokenizer import Tokenizer

log = logging.getLogger("oxibonsai.server")

ENGINE_DEPLOYMENT = "OxiBonsaiEngine"
INGRESS_DEPLOYMENT = "OxiBonsaiIngress"
ROUTINGS = ("prefix", "pow2")


def build_ray_app(
    model: str | None,
    config: ServerConfig,
    *,
    replicas: int = 2,
    routing: str = "prefix",
    engine_args: dict[str, Any] | None = None,
    app_name: str = "oxibonsai",
    replica_cpus: float = 1.0,
) -> serve.Application:
    """The application: bind it with ``serve.run(app, name=app_name, route_prefix="/")`` after
    ``ray.init``. ``engine_args`` are ``AsyncLLM``'s (``num_threads`` sets each replica's kernel
    threads); ``routing`` is ``"prefix"`` (``PrefixAffinityRouter``) or ``"pow2"`` (Serve's default)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    model_path = str(model) if model is not None else str(default_model_path())
    engine_args = dict(engine_args or {})
    _ensure_board(app_name)
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}},
        health_check_period_s=2,
        health_check_timeout_s=30,
        **_queue_limits(engine_args, replicas),
        **_router(routing, engine_args),
    ).bind(model_path, engine_args, app_name, config.served_model_name, config.prefix_cache_file)
    max_model_len = engine_args.get("max_model_len")
    rope_scaling = RopeScaling.parse(engine_args.get("rope_scaling"))
    generation_config = engine_args.get("generation_config", "auto")

    def builder() -> FastAPI:  # a plain function: Serve calls it on the ingress replica
        return _ingress_app(model_path, config, app_name, max_model_len, rope_scaling, generation_config)

    ingress = serve.deployment(
        serve.ingress(builder)(), name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(engine)


def _queue_limits(engine_args: dict[str, Any], replicas: int) -> dict[str, int]:
    """Serve's limits matched to the engines': a replica takes what it can run and queue; Serve queues
    at most what the replicas would (unbounded when their queues are)."""
    seqs = int(engine_args.get("max_num_seqs") or 8)
    waiting = engine_args.get("max_waiting")
    ongoing = seqs + (int(waiting) if waiting is not None else 4 * seqs)
    queued = max(1, int(waiting) * replicas) if waiting is not None else -1  # Serve's minimum is 1
    return {"max_ongoing_requests": ongoing, "max_queued_requests": queued}


def _router(routing: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    """The router and its imbalance bound: a replica may hold one full batch (``max_num_seqs``) more
    than the least loaded before a matching prefix stops winning (a smaller bound splits every group
    across replicas as soon as a few long prefills overlap; measured in BENCHMARKS.md)."""
    if routing == "pow2":
        return {}
    kwargs = {"imbalance": int(engine_args.get("max_num_seqs") or 8)}
    config = RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs=kwargs)
    return {"request_router_config": config}


def _ensure_board(app_name: str) -> None:
    name = board_name(app_name)
    try:
        ray.get_actor(name, namespace=BOARD_NAMESPACE)
    except ValueError:
        MetricsBoard.options(name=name, namespace=BOARD_NAMESPACE, lifetime="detached").remote()


def _ingress_app(
    model_path: str,
    config: ServerConfig,
    app_name: str,
    max_model_len: int | None,
    rope_scaling: RopeScaling | None,
    generation_config: str,
) -> FastAPI:
    """The single-process server's app over the engine deployment (built on the ingress replica)."""
    file = GGUFFile(model_path)
    metadata = file.metadata
    context = int(metadata.get("qwen3.context_length") or DEFAULT_MAX_MODEL_LEN)
    scaling = rope_scaling or RopeScaling.parse(gguf_rope_scaling(file))
    context = context if scaling is None else scaling.max_positions(context)  # the replicas' default
    remote = RemoteEngine(
        serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app_name),
        ray.get_actor(board_name(app_name), namespace=BOARD_NAMESPACE),
        Tokenizer.from_gguf_metadata(metadata),
        max_model_len=max_model_len or min(context, DEFAULT_MAX_MODEL_LEN),
        block_size=BLOCK_TOKENS,
        default_sampling_fields=model_sampling_defaults(metadata, generation_config),
    )
    # The replicas load the prefix-cache file (EngineReplica); the ingress holds no KV.
    ingress_config = dataclasses.replace(config, prefix_cache_file=None)
    return build_app(lambda: remote, ingress_config)  # type: ignore[arg-type, return-value]


def serve_ray(args: argparse.Namespace, config: ServerConfig, engine_args: dict[str, Any]) -> int:
    """``oxibonsai serve --replicas N``: runs until SIGINT/SIGTERM; the exit status."""
    started_ray = not ray.is_initialized() and args.ray_address is None
    ray.init(address=args.ray_address, include_dashboard=False, ignore_reinit_error=True)
    # Ours from here on (after ray.init, which installs its own): a signal during start-up, once the
    # app already answers, still ends in serve.shutdown() and ray.shutdown() below.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=HTTPOptions(host=args.host, port=args.port))
        app = build_ray_app(
            args.model, config, replicas=args.replicas, routing=args.routing, engine_args=engine_args
        )
        serve.run(app, name="oxibonsai", route_prefix="/")
        log.info("serving %d replicas on http://%s:%d", args.replicas, args.host, args.port)
        stop.wait()
        return 0
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()

"""The ``oxibonsai serve`` flags, spelled as vLLM's where vLLM has the flag, and the ``AsyncLLM``
arguments they give. Light to import (no FastAPI, no uvicorn): every ``oxibonsai`` command builds its
parser from it."""

from __future__ import annotations

import argparse
from typing import Any

from oxibonsai.generation_config import GENERATION_CONFIGS
from oxibonsai.rope_scaling import RopeScaling
from oxibonsai.server.config import DEFAULT_MAX_BODY_BYTES
from oxibonsai.structured_output import REASONING_TOKENS


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="path to a .gguf (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None, help="required Bearer key (repeatable)")
    p.add_argument(
        "--served-model-name", default=None, help="model id clients use (default: the GGUF's name)"
    )
    engine = p.add_argument_group("engine")
    engine.add_argument("--num-threads", "--threads", type=int, default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=8)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--max-waiting", type=int, default=None, help="waiting requests before 503")
    engine.add_argument("--kv-cache-bytes", type=int, default=None)
    engine.add_argument("--kv-cache-blocks", type=int, default=None)
    add_kv_dtype_flag(engine)
    add_device_flags(engine)
    add_rope_flags(engine)
    add_generation_config_flag(engine)
    add_speculative_flag(engine)
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--scheduling-policy", default="priority", choices=["priority", "longest_prefix"])
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument(
        "--prefix-cache-file",
        default=None,
        help="load the prefix cache from this file at start, save it at exit",
    )
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_TOKENS),
        help="split <think> blocks into reasoning_content; structured output starts after them",
    )
    scale = p.add_argument_group("scale-out (Ray Serve; pip install 'oxibonsai[ray]')")
    scale.add_argument("--replicas", type=int, default=1, help="engine replicas behind one endpoint")
    scale.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start one)")
    scale.add_argument("--routing", default="prefix", choices=["prefix", "pow2"])
    server = p.add_argument_group("server")
    server.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    server.add_argument("--allowed-origins", action="append", default=None, help="CORS origin (repeatable)")
    server.add_argument("--enable-force-include-usage", "--force-include-usage", action="store_true")
    server.add_argument("--overload-status", type=int, default=503, choices=[503, 429])
    server.add_argument("--shutdown-timeout", type=float, default=30.0)
    server.add_argument("--sse-keepalive-interval", type=float, default=15.0, help="seconds; 0: none")
    server.add_argument("--keep-alive-on-engine-death", action="store_true")
    server.add_argument("--disable-uvicorn-access-log", action="store_true")
    server.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def add_device_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Where the model runs (shared by ``serve``, ``generate`` and ``chat``)."""
    p.add_argument("--device", default="auto", help="auto (CUDA, MPS, then CPU), cpu, cuda, cuda:N or mps")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "torch"])
    p.add_argument("--host-kv-cache-blocks", type=int, default=None, help="host tier blocks (torch runner)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")


def device_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "device": args.device,
        "runner": args.runner,
        "host_kv_cache_blocks": args.host_kv_cache_blocks,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
    }


def add_rope_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The model's rope scaling and base, replacing the file's (vLLM's ``--rope-scaling`` JSON)."""
    p.add_argument(
        "--rope-scaling",
        type=_rope_scaling,
        default=None,
        help='JSON, e.g. \'{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}\'',
    )
    p.add_argument("--rope-theta", type=float, default=None, help="the rotary base (default: the file's)")


def rope_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"rope_scaling": args.rope_scaling, "rope_theta": args.rope_theta}


def _rope_scaling(text: str) -> RopeScaling | None:
    try:
        return RopeScaling.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_generation_config_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """vLLM's ``--generation-config``: ``auto`` samples with the GGUF's recommended defaults where a
    request leaves a field unset, ``vllm`` with the library's (``oxibonsai.generation_config``)."""
    p.add_argument(
        "--generation-config",
        default="auto",
        choices=list(GENERATION_CONFIGS),
        help="auto: unset sampling fields take the GGUF's general.sampling.* values; vllm: ignore them",
    )


def add_speculative_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """vLLM's ``--speculative-config``: n-gram speculative decoding as JSON, e.g.
    ``'{"method": "ngram", "num_speculative_tokens": 4}'`` (``oxibonsai.speculative``)."""
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
    )


def _speculative_config(text: str) -> Any:
    from oxibonsai.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


KV_CACHE_DTYPES = ["auto", "f16", "f32", "int8"]


def add_kv_dtype_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--kv-cache-dtype``: f16 (``auto``), f32 or, on the native runner, int8."""
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **device_args(args),
        **rope_args(args),
        "num_threads": args.num_threads,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_waiting": args.max_waiting,
        "kv_cache_bytes": args.kv_cache_bytes,
        "kv_cache_blocks": args.kv_cache_blocks,
        "kv_cache_dtype": args.kv_cache_dtype,
        "seed": args.seed,
        "scheduling_policy": args.scheduling_policy,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "reasoning_parser": args.reasoning_parser,
        "generation_config": args.generation_config,
        "speculative_config": args.speculative_config,
    }

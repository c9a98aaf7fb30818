"""The first run on a lent GPU: every figure of research/gpu-path.md §7.4 that the eager torch path can
give, each speed beside a baseline measured in the same run, written as JSON to --out.

Sections (--sections picks some; each records its error and the run goes on):

- probe: torch/triton versions, the device, device-to-device copy GB/s (B1, bytes read + written),
  pinned host->device and device->host GB/s of one large copy.
- q1: the Triton ``q1_linear`` on random ``Q1Weight``s of the Bonsai-1.7B and 8B shapes at M in
  {1, 16, 64, 512}: GB/s of weight bytes (rows*cols*18/128) and its ratio to B1; B2 = fp16
  ``torch.matmul`` on the dequantized weight; relative error against ``ref_torch.q1_linear``. Timed in
  a CUDA graph over enough weight copies that they do not fit in L2 (eager time per call beside it).
- decode: ``TorchQwen3.forward`` on random Bonsai-1.7B/8B-shaped weights over an fp16 ``KvPool``,
  eager (the torch path has no CUDA graphs yet): decode tokens/s at batch 1/16/64 after a 512-token
  context (random KV written into the pool, not prefilled), and prefill of 512 tokens; B2 = the same
  forward with fp16 dense weights (dequantized; ~3.4 GB for 1.7B, ~16 GB for 8B).
- tier: promote GB/s of 64 scattered 1.7B-shaped blocks (``copy_blocks`` from a pinned host pool)
  against one large pinned copy of the same bytes, and the same for demotion; then, through
  ``oxibonsai.LLM(device="cuda", runner="torch")`` on a random Bonsai-1.7B-shaped GGUF, the TTFT of a
  request whose 1,024-token prefix was demoted to the host tier, against a cold prefill (and a device
  hit), with ``cache_stats()`` promotions as proof.

``--smoke`` runs all of it on the CPU with tiny shapes (the Triton q1 kernels under
``TRITON_INTERPRET=1``, the model on the reference ops) in about a minute, writing the same keys.
A global ``--budget-s`` skips what is left once spent. The lent machine has no Rust and no network, so
the lead builds ``.device/`` here first (it carries the native module and pure-Python wheels):

    bash scripts/device_bundle.sh
    # device tool: run(carry=[".device"], timeout_s=480,
    #                  command="bash .device/run.sh python3 benches/bench_gpu.py --out $OUT/gpu.json")
    python benches/bench_gpu.py --smoke --out /tmp/gpu-smoke.json   # here, on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

import oxibonsai
from oxibonsai.torch_backend.batch import BLOCK_TOKENS, DeviceBatch, StepBatch
from oxibonsai.torch_backend.kv_pool import KvPool, copy_blocks
from oxibonsai.torch_backend.model import TorchQwen3
from oxibonsai.torch_backend.ops import ref_torch
from oxibonsai.torch_backend.ops.dispatch import OP_NAMES, ops_for
from oxibonsai.torch_backend.ops.q1_weight import QK, Q1Weight, unpack
from oxibonsai.torch_backend.weights import DenseWeight, LayerWeights, Qwen3Config, Qwen3Weights

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
SEED = 0
GIB = 1 << 30
SECTIONS = ("probe", "q1", "decode", "tier")
SHARES = {"q1": 0.4, "decode": 0.8}  # of --budget-s: where q1 and decode stop starting new cases
ROUND_COUNTERS = ("promotions", "demotions", "host_hit_tokens", "computed_tokens")  # cache_stats per round
NOTES = [
    "B1 = device-to-device copy GB/s counting bytes read + written; q1 GB/s counts weight bytes read",
    "decode/prefill are eager: no CUDA graphs in the torch path yet; paged_attention syncs the host "
    "once per layer (its kernel choice); decode context KV is random data written into the pool",
    "B2 = the same computation on fp16 dense (dequantized) weights with torch.matmul",
]


def qwen3(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> Qwen3Config:
    return Qwen3Config(layers, hidden, ffn, heads, kv_heads, 128, vocab, 32768, 1e6, 1e-6)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: Qwen3Config
    tied: bool


BONSAI_1P7B = ModelSpec("bonsai-1.7b", qwen3(28, 2048, 6144, 16, 8, 151936), tied=True)
BONSAI_8B = ModelSpec("bonsai-8b", qwen3(36, 4096, 12288, 32, 8, 151936), tied=False)
TINY_TIED = ModelSpec("tiny-tied", qwen3(2, 256, 384, 4, 2, 384), tied=True)
TINY_UNTIED = ModelSpec("tiny-untied", qwen3(2, 256, 384, 4, 2, 384), tied=False)


@dataclass(frozen=True)
class Plan:
    """Every size one mode uses: the GPU run or the CPU smoke run."""

    device: str
    models: tuple[ModelSpec, ...]
    q1_roles: tuple[str, ...]
    q1_m: tuple[int, ...]
    batches: tuple[int, ...]
    context: int
    decode_steps: int
    prefill_tokens: int
    copy_bytes: int
    promote_blocks: int
    ttft_prefix: int
    ttft_tail: int
    ttft_repeats: int
    warmup: int
    reps: int
    rotate_bytes: int = 256 << 20  # weight copies cycled through when timing, to stay out of L2
    max_copies: int = 512


GPU_PLAN = Plan(
    device="cuda", models=(BONSAI_1P7B, BONSAI_8B), q1_roles=("q", "kv", "gate", "down", "head"),
    q1_m=(1, 16, 64, 512), batches=(1, 16, 64), context=512, decode_steps=16, prefill_tokens=512,
    copy_bytes=GIB, promote_blocks=64, ttft_prefix=1024, ttft_tail=16, ttft_repeats=3, warmup=2, reps=10,
)  # fmt: skip
SMOKE_PLAN = Plan(
    device="cpu", models=(TINY_TIED, TINY_UNTIED), q1_roles=("kv", "down"), q1_m=(1, 16), batches=(1, 16),
    context=32, decode_steps=2, prefill_tokens=32, copy_bytes=16 << 20, promote_blocks=8, ttft_prefix=64,
    ttft_tail=16, ttft_repeats=1, warmup=1, reps=2, max_copies=1,
)  # fmt: skip


@dataclass
class Budget:
    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def over(self) -> bool:
        return self.spent() > self.seconds

    def skipped(self) -> dict[str, str]:
        return {"skipped": f"time budget of {self.seconds:.0f} s spent"}

    def share(self, fraction: float) -> Budget:
        """The same clock with an earlier deadline, so one section cannot starve the ones after it."""
        return Budget(self.seconds * fraction, self.start)


def guarded(fn: Callable[[], dict[str, Any]], **label: Any) -> dict[str, Any]:
    """``fn()``, or its error as a record: one failing case never loses the others."""
    try:
        return {**label, **fn()}
    except Exception as e:  # recorded, and the run goes on
        traceback.print_exc()
        return {**label, "error": f"{type(e).__name__}: {e}"}


# -- timing -------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall-clock ms of ``fn()`` with the device drained before and after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def loop_ms(calls: Sequence[Callable[[], object]], device: torch.device) -> float:
    """ms for one pass over ``calls`` (CUDA events on a GPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for call in calls:
        call()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end))


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end))


def time_calls(calls: Sequence[Callable[[], object]], device: torch.device, reps: int) -> dict[str, Any]:
    """Per-call ms over ``calls``: from CUDA graph replays on a GPU (no launch gaps), wall clock
    elsewhere; ``eager_ms`` is one plain pass, launch overhead included."""
    for call in calls:
        call()  # compile, allocate
    sync(device)
    eager = loop_ms(calls, device) / len(calls)
    if device.type != "cuda":
        return {"ms": statistics.median(loop_ms(calls, device) for _ in range(reps)) / len(calls),
                "eager_ms": eager, "timing": "wall"}  # fmt: skip
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
    except Exception as e:  # fall back to events, and say so
        sync(device)
        return {"ms": statistics.median(loop_ms(calls, device) for _ in range(reps)) / len(calls),
                "eager_ms": eager, "timing": f"events (graph capture failed: {e})"}  # fmt: skip
    replay_ms(graph)
    return {"ms": statistics.median(replay_ms(graph) for _ in range(reps)) / len(calls),
            "eager_ms": eager, "timing": "cuda_graph"}  # fmt: skip


def gbps(nbytes: float, ms: float | None) -> float | None:
    return nbytes / (ms * 1e-3) / 1e9 if ms else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- probe ----------------------------------------------------------------------------------------------


def probe(plan: Plan, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "triton": package_version("triton"),
                           "python": platform.python_version(), "device": str(device)}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out |= {"name": props.name, "sms": props.multi_processor_count, "total_memory": props.total_memory,
                "l2_bytes": getattr(props, "L2_cache_size", None)}  # fmt: skip
    src = torch.randint(0, 255, (plan.copy_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    d2d = statistics.median(loop_ms([partial(dst.copy_, src)], device) for _ in range(plan.reps))
    out["copy_bytes"] = plan.copy_bytes
    out["d2d_gbps"] = gbps(2 * plan.copy_bytes, d2d)
    cuda = device.type == "cuda"
    host = torch.empty(plan.copy_bytes, dtype=torch.uint8, pin_memory=cuda)
    out["h2d_gbps"] = gbps(plan.copy_bytes, wall_ms(lambda: dst.copy_(host, non_blocking=cuda), device, 1, 5))
    out["d2h_gbps"] = gbps(plan.copy_bytes, wall_ms(lambda: host.copy_(dst, non_blocking=cuda), device, 1, 5))
    return out


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# -- random weights ---------------------------------------------------------------------------------------


def random_q1(rows: int, cols: int, std: float, device: torch.device) -> Q1Weight:
    """Random sign words and fp16 scales ~ N(0, std²)."""
    signs = torch.randint(-(2**31), 2**31, (rows, cols // 32), dtype=torch.int32, device=device)
    scales = (torch.randn(rows, cols // QK, device=device) * std).to(torch.float16)
    return Q1Weight(signs=signs, scales=scales, rows=rows, cols=cols)


def dequantize_half(w: Q1Weight, chunk_floats: int = 1 << 24) -> torch.Tensor:
    """fp16 ``[rows, cols]``, dequantized a slice of rows at a time (bounded scratch memory)."""
    out = torch.empty(w.rows, w.cols, dtype=torch.float16, device=w.signs.device)
    step = max(1, chunk_floats // w.cols)
    for start in range(0, w.rows, step):
        out[start : start + step] = unpack(w.signs[start : start + step], w.scales[start : start + step])
    return out


class HalfDense(DenseWeight):
    """A dense fp16 matrix served through ``torch.matmul`` in fp16 (B2): the model's float32
    activations are cast down, the product cast back up."""

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float16) @ self.w.T).float()

    def rows_dequantized(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.index_select(0, ids).float()


def random_weights(spec: ModelSpec, device: torch.device) -> Qwen3Weights:
    c = spec.config

    def mat(rows: int, cols: int) -> Q1Weight:
        return random_q1(rows, cols, 1 / math.sqrt(cols), device)

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, device=device)

    def layer() -> LayerWeights:
        return LayerWeights(norm(c.hidden), mat(c.q_dim, c.hidden), mat(c.kv_dim, c.hidden),
                            mat(c.kv_dim, c.hidden), mat(c.hidden, c.q_dim), norm(c.head_dim),
                            norm(c.head_dim), norm(c.hidden), mat(c.ffn, c.hidden), mat(c.ffn, c.hidden),
                            mat(c.hidden, c.ffn))  # fmt: skip

    layers = tuple(layer() for _ in range(c.n_layers))
    output = None if spec.tied else mat(c.vocab, c.hidden)
    return Qwen3Weights(mat(c.vocab, c.hidden), layers, norm(c.hidden), output)


def half_dense(weights: Qwen3Weights) -> Qwen3Weights:
    """The same model with every matrix dequantized to fp16 (a tied head stays tied)."""

    def dense(w: Any) -> Any:
        return HalfDense(dequantize_half(w)) if isinstance(w, Q1Weight) else w

    layers = tuple(
        LayerWeights(**{name: dense(getattr(layer, name)) for name in LayerWeights.__dataclass_fields__})
        for layer in weights.layers
    )
    output = None if weights.output is None else dense(weights.output)
    return Qwen3Weights(dense(weights.token_embd), layers, weights.output_norm, output)


def streamed_bytes(weights: Qwen3Weights) -> int:
    """Matrix bytes one decode step reads: every layer's matrices and the LM head."""
    names = [n for n in LayerWeights.__dataclass_fields__ if n.startswith("w")]
    layers = sum(getattr(layer, n).nbytes for layer in weights.layers for n in names)
    return int(layers + weights.lm_head.nbytes)


# -- q1 ---------------------------------------------------------------------------------------------------


def q1_shapes(spec: ModelSpec, roles: Sequence[str]) -> list[tuple[str, int, int]]:
    c = spec.config
    shapes = {"q": (c.q_dim, c.hidden), "kv": (c.kv_dim, c.hidden), "gate": (c.ffn, c.hidden),
              "down": (c.hidden, c.ffn), "head": (c.vocab, c.hidden)}  # fmt: skip
    return [(f"{spec.name}.{role}", *shapes[role]) for role in roles]


def q1_section(plan: Plan, device: torch.device, budget: Budget, b1: float | None) -> dict[str, Any]:
    from oxibonsai.torch_backend.ops import q1_triton

    rows: list[dict[str, Any]] = []
    for spec in plan.models:
        for name, n, k in q1_shapes(spec, plan.q1_roles):
            if budget.over():
                rows.append({"shape": name, **budget.skipped()})
                continue
            rows += q1_shape(q1_triton.q1_linear, name, n, k, plan, device, b1)
            gc.collect()
    return {"b1_d2d_gbps": b1, "kernel": "q1_triton.q1_linear", "rows": rows}


def copies(nbytes: int, plan: Plan) -> int:
    return max(1, min(plan.max_copies, -(-plan.rotate_bytes // nbytes)))


def q1_shape(
    kernel: Callable[..., torch.Tensor], name: str, n: int, k: int, plan: Plan, device: torch.device,
    b1: float | None,
) -> list[dict[str, Any]]:  # fmt: skip
    q1_bytes, fp16_bytes = n * k * 18 // 128, n * k * 2
    torch.manual_seed(SEED)
    ours = [random_q1(n, k, 0.02, device) for _ in range(copies(q1_bytes, plan))]
    dense = [dequantize_half(w) for w in ours[: copies(fp16_bytes, plan)]]
    out = []
    for m in plan.q1_m:
        label = {"shape": name, "rows": n, "cols": k, "m": m, "weight_bytes": q1_bytes}
        out.append(guarded(partial(q1_case, kernel, ours, dense, m, plan, device, b1), **label))
    return out


def q1_case(
    kernel: Callable[..., torch.Tensor], ours: list[Q1Weight], dense: list[torch.Tensor], m: int,
    plan: Plan, device: torch.device, b1: float | None,
) -> dict[str, Any]:  # fmt: skip
    w0 = ours[0]
    x = torch.randn(m, w0.cols, device=device)
    x16 = x.to(torch.float16)
    got, want = kernel(x, w0), ref_torch.q1_linear(x, w0)
    mine = time_calls([partial(kernel, x, w) for w in ours], device, plan.reps)
    base = time_calls([partial(torch.matmul, x16, w.T) for w in dense], device, plan.reps)
    ours_gbps = gbps(w0.rows * w0.cols * 18 / 128, mine["ms"])
    return {
        "ours_ms": mine["ms"], "ours_eager_ms": mine["eager_ms"], "timing": mine["timing"],
        "weight_copies": len(ours), "ours_gbps": ours_gbps, "ours_over_b1": ratio(ours_gbps, b1),
        "b2_ms": base["ms"], "b2_gbps": gbps(w0.rows * w0.cols * 2, base["ms"]),
        "speedup_vs_b2": ratio(base["ms"], mine["ms"]),
        "rel_err": float((got - want).norm() / want.norm()), "finite": bool(torch.isfinite(got).all()),
    }  # fmt: skip


# -- decode and prefill ----------------------------------------------------------------------------------


def decode_section(plan: Plan, device: torch.device, budget: Budget) -> dict[str, Any]:
    ops = ops_for(device)
    models = []
    for spec in plan.models:
        if budget.over():
            models.append({"model": spec.name, **budget.skipped()})
            continue
        print(f"[{budget.spent():6.1f} s] decode {spec.name}", flush=True)
        models.append(guarded(partial(model_record, spec, plan, device, budget, ops), model=spec.name))
        free(device)
    return {"ops": {name: getattr(ops, name).__module__ for name in OP_NAMES}, "models": models}


def model_record(spec: ModelSpec, plan: Plan, device: torch.device, budget: Budget, ops: Any) -> dict:
    torch.manual_seed(SEED)
    weights = random_weights(spec, device)
    per_seq = blocks_for(plan.context + plan.warmup + plan.decode_steps + 1)
    pool = KvPool(spec.config.n_layers, max(plan.batches) * per_seq, spec.config.n_kv_heads,
                  spec.config.head_dim, torch.float16, device)  # fmt: skip
    pool.data.normal_()
    ours = run_phases(TorchQwen3(spec.config, weights, ops), pool, plan, device, budget)
    dense_weights = None if budget.over() else half_dense(weights)
    b2 = [] if dense_weights is None else run_phases(TorchQwen3(spec.config, dense_weights, ops), pool,
                                                     plan, device, budget)  # fmt: skip
    streamed = streamed_bytes(weights)
    return {
        "config": dataclasses.asdict(spec.config), "tied": spec.tied, "kv_dtype": "float16",
        "weights_bytes": weights.nbytes, "streamed_bytes_per_step": streamed,
        "b2_weights_bytes": dense_weights.nbytes if dense_weights is not None else None,
        "results": join_phases(ours, b2, streamed),
    }  # fmt: skip


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def run_phases(model: TorchQwen3, pool: KvPool, plan: Plan, device: torch.device, budget: Budget) -> list:
    rng = np.random.default_rng(SEED)
    out = []
    for batch in plan.batches:
        label = {"phase": "decode", "batch": batch, "context": plan.context}
        if budget.over():
            out.append({**label, **budget.skipped()})
            continue
        out.append(guarded(partial(decode_rate, model, pool, batch, plan, device, rng), **label))
    label = {"phase": "prefill", "batch": 1, "tokens": plan.prefill_tokens}
    out.append({**label, **budget.skipped()} if budget.over() else
               guarded(partial(prefill_rate, model, pool, plan, device, rng), **label))  # fmt: skip
    return out


def decode_rate(
    model: TorchQwen3, pool: KvPool, batch: int, plan: Plan, device: torch.device, rng: np.random.Generator
) -> dict[str, Any]:
    steps = plan.warmup + plan.decode_steps
    per_seq = blocks_for(plan.context + steps + 1)
    tables = rng.permutation(pool.num_blocks)[: batch * per_seq].reshape(batch, per_seq).tolist()
    vocab = model.config.vocab
    plans = [
        StepBatch.for_sequences([(t, plan.context + s, [int(rng.integers(vocab))], "last") for t in tables])
        for s in range(steps)
    ]
    batches = [p.to_device(device) for p in plans]
    seconds = timed_forwards(model, pool, batches, plan.warmup, device)
    return {"tok_s": batch * plan.decode_steps / seconds, "step_ms": seconds / plan.decode_steps * 1e3,
            "steps": plan.decode_steps}  # fmt: skip


def prefill_rate(
    model: TorchQwen3, pool: KvPool, plan: Plan, device: torch.device, rng: np.random.Generator
) -> dict[str, Any]:
    tokens = rng.integers(model.config.vocab, size=plan.prefill_tokens).tolist()
    table = rng.permutation(pool.num_blocks)[: blocks_for(plan.prefill_tokens)].tolist()
    batch = StepBatch.for_sequences([(table, 0, tokens, "last")]).to_device(device)
    reps = max(1, plan.reps // 3)
    seconds = timed_forwards(model, pool, [batch] * (plan.warmup + reps), plan.warmup, device) / reps
    return {"tok_s": plan.prefill_tokens / seconds, "step_ms": seconds * 1e3, "steps": reps}


def timed_forwards(
    model: TorchQwen3, pool: KvPool, batches: list[DeviceBatch], warmup: int, device: torch.device
) -> float:
    """Seconds for ``batches[warmup:]``, run back to back after the first ``warmup``."""
    for batch in batches[:warmup]:
        model.forward(batch, pool)
    sync(device)
    start = time.perf_counter()
    for batch in batches[warmup:]:
        model.forward(batch, pool)
    sync(device)
    return time.perf_counter() - start


def join_phases(ours: list[dict], b2: list[dict], streamed: int) -> list[dict[str, Any]]:
    """One record per phase and batch: ours, B2 and their ratio; at batch 1 the weight GB/s."""
    base = {(r["phase"], r["batch"]): r for r in b2}
    out = []
    for r in ours:
        other = base.get((r["phase"], r["batch"]), {})
        row = {**{k: v for k, v in r.items() if k not in ("tok_s", "step_ms")},
               "ours_tok_s": r.get("tok_s"), "ours_step_ms": r.get("step_ms"),
               "b2_tok_s": other.get("tok_s"), "b2_step_ms": other.get("step_ms"),
               "speedup_vs_b2": ratio(r.get("tok_s"), other.get("tok_s"))}  # fmt: skip
        if "error" in other or "skipped" in other:
            row["b2_error"] = other.get("error") or other.get("skipped")
        if r["phase"] == "decode" and r["batch"] == 1 and r.get("tok_s"):
            row["weight_gbps"] = streamed * r["tok_s"] / 1e9
        out.append(row)
    return out


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- host tier --------------------------------------------------------------------------------------------


def tier_section(plan: Plan, device: torch.device, budget: Budget) -> dict[str, Any]:
    promote = guarded(partial(promote_record, plan, device))
    free(device)
    ttft = budget.skipped() if budget.over() else guarded(partial(ttft_record, plan, device))
    free(device)
    return {"promote": promote, "ttft": ttft}


def promote_record(plan: Plan, device: torch.device) -> dict[str, Any]:
    c, n, cuda = plan.models[0].config, plan.promote_blocks, device.type == "cuda"
    host = KvPool(c.n_layers, 4 * n, c.n_kv_heads, c.head_dim, torch.float16, "cpu", pin=cuda)
    dev = KvPool(c.n_layers, 2 * n, c.n_kv_heads, c.head_dim, torch.float16, device)
    rng = np.random.default_rng(SEED)
    pairs = np.stack([rng.choice(4 * n, n, replace=False), rng.choice(2 * n, n, replace=False)], axis=1)
    src = torch.from_numpy(pairs[:, 0].copy())
    expected = torch.randn(host.data[:, :, src].shape).to(torch.float16)
    host.data.index_copy_(2, src, expected)
    promote = wall_ms(lambda: copy_blocks(host, dev, pairs), device, plan.warmup, plan.reps)
    moved = dev.data[:, :, torch.from_numpy(pairs[:, 1].copy()).to(device)].cpu()
    demote = wall_ms(lambda: copy_blocks(dev, host, pairs[:, ::-1].copy()), device, plan.warmup, plan.reps)
    nbytes = n * host.block_bytes
    big_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    big_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = wall_ms(lambda: big_dev.copy_(big_host, non_blocking=cuda), device, plan.warmup, plan.reps)
    d2h = wall_ms(lambda: big_host.copy_(big_dev, non_blocking=cuda), device, plan.warmup, plan.reps)
    promote_gbps, h2d_gbps = gbps(nbytes, promote), gbps(nbytes, h2d)
    demote_gbps, d2h_gbps = gbps(nbytes, demote), gbps(nbytes, d2h)
    return {
        "model": plan.models[0].name, "blocks": n, "block_bytes": host.block_bytes, "bytes": nbytes,
        "host_pinned": host.pinned, "copied_exactly": bool(torch.equal(moved, expected)),
        "promote_ms": promote, "promote_gbps": promote_gbps, "large_h2d_gbps": h2d_gbps,
        "promote_over_large": ratio(promote_gbps, h2d_gbps), "demote_ms": demote,
        "demote_gbps": demote_gbps, "large_d2h_gbps": d2h_gbps,
        "demote_over_large": ratio(demote_gbps, d2h_gbps),
    }  # fmt: skip


@dataclass
class TtftRun:
    """One ``LLM`` on a random GGUF, with a device pool two prompts large and a larger host tier."""

    llm: oxibonsai.LLM
    prompt_tokens: int
    vocab: int
    rng: np.random.Generator

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(self.vocab, size=n).tolist()

    def request(self, ids: list[int]) -> float:
        """TTFT in ms of one request (one token generated)."""
        params = oxibonsai.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        out = self.llm.generate({"prompt_token_ids": ids}, params)[0]
        assert out.metrics.time_to_first_token is not None
        return out.metrics.time_to_first_token * 1e3

    def fill(self) -> None:
        """Enough other prompts to push every idle block out of the device pool (to the host)."""
        blocks = self.llm.cache_stats()["capacity_blocks"]
        for _ in range(blocks // blocks_for(self.prompt_tokens) + 2):
            self.request(self.ids(self.prompt_tokens))


def ttft_record(plan: Plan, device: torch.device) -> dict[str, Any]:
    factory = import_tests_module("model_factory")
    cfg = factory.bonsai_1p7b_config() if device.type == "cuda" else factory.TinyQwen3Config()
    path = Path(tempfile.mkdtemp(prefix="bench-gpu-")) / "ttft.gguf"
    start = time.perf_counter()
    factory.write_qwen3_gguf(path, cfg, np.random.default_rng(SEED))
    written = time.perf_counter()
    prompt = plan.ttft_prefix + plan.ttft_tail
    run = TtftRun(load_ttft_llm(path, plan, prompt), prompt, cfg.vocab_size, np.random.default_rng(SEED))
    loaded = time.perf_counter()
    warm_ttft(run, plan)
    rounds = [ttft_round(run, plan) for _ in range(plan.ttft_repeats)]
    cold = statistics.median(r["cold_ms"] for r in rounds)
    promoted = statistics.median(r["promoted_ms"] for r in rounds)
    stats = run.llm.cache_stats()
    prefix_blocks = plan.ttft_prefix // BLOCK_TOKENS
    path.unlink()
    return {
        "gguf": cfg.name, "write_s": written - start, "load_s": loaded - written,
        "prefix_tokens": plan.ttft_prefix, "tail_tokens": plan.ttft_tail,
        "max_num_batched_tokens": prompt + 16,
        "device_blocks": stats["capacity_blocks"], "host_blocks": stats["host_capacity_blocks"],
        "cold_ttft_ms": cold, "device_hit_ttft_ms": statistics.median(r["device_hit_ms"] for r in rounds),
        "promoted_ttft_ms": promoted, "promoted_over_cold": ratio(promoted, cold),
        "all_prefix_blocks_promoted": all(r["promotions"] >= prefix_blocks for r in rounds),
        "rounds": rounds, "cache_stats": stats,
    }  # fmt: skip


def import_tests_module(name: str) -> Any:
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    return importlib.import_module(name)


def load_ttft_llm(path: Path, plan: Plan, prompt: int) -> oxibonsai.LLM:
    """Prefill in one step (no chunking); room for two prompts on the device, eight on the host."""
    per_prompt = blocks_for(prompt + 1)
    return oxibonsai.LLM(
        str(path), device=plan.device, runner="torch", max_model_len=prompt + 16, max_num_seqs=1,
        max_num_batched_tokens=prompt + 16, kv_cache_dtype="f16", kv_cache_blocks=2 * per_prompt + 4,
        host_kv_cache_blocks=8 * per_prompt,
    )  # fmt: skip


def warm_ttft(run: TtftRun, plan: Plan) -> None:
    """Every path once (cold, device hit, promoted), so no kernel compiles inside a timed request."""
    prefix = run.ids(plan.ttft_prefix)
    run.request(prefix + run.ids(plan.ttft_tail))
    run.request(prefix + run.ids(plan.ttft_tail))
    run.fill()
    run.request(prefix + run.ids(plan.ttft_tail))


def ttft_round(run: TtftRun, plan: Plan) -> dict[str, Any]:
    prefix = run.ids(plan.ttft_prefix)
    cold = run.request(prefix + run.ids(plan.ttft_tail))
    device_hit = run.request(prefix + run.ids(plan.ttft_tail))
    run.fill()
    before = run.llm.cache_stats()
    promoted = run.request(prefix + run.ids(plan.ttft_tail))
    after = run.llm.cache_stats()
    delta = {k: after[k] - before[k] for k in ROUND_COUNTERS}
    return {"cold_ms": cold, "device_hit_ms": device_hit, "promoted_ms": promoted, **delta}


# -- report -----------------------------------------------------------------------------------------------


def run_sections(args: argparse.Namespace, plan: Plan, report: dict[str, Any]) -> None:
    device, budget = torch.device(plan.device), Budget(args.budget_s)
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "probe": lambda: probe(plan, device),
        "q1": lambda: q1_section(plan, device, budget.share(SHARES["q1"]), report_b1(report)),
        "decode": lambda: decode_section(plan, device, budget.share(SHARES["decode"])),
        "tier": lambda: tier_section(plan, device, budget),
    }
    for name in SECTIONS:
        if name not in args.sections:
            continue
        print(f"[{budget.spent():6.1f} s] {name}", flush=True)
        start = time.perf_counter()
        report[name] = budget.skipped() if budget.over() else guarded(jobs[name])
        report[name]["seconds"] = time.perf_counter() - start
        report["meta"]["elapsed_s"] = budget.spent()
        write_report(args.out, report)
        free(device)


def report_b1(report: dict[str, Any]) -> float | None:
    """B1 from the probe section, if it ran."""
    b1: float | None = report.get("probe", {}).get("d2d_gbps")
    return b1


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial_path = path.with_suffix(".partial")
    partial_path.write_text(json.dumps(report, indent=1, default=str))
    os.replace(partial_path, path)


def fmt(value: Any, spec: str = ".1f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def micros(ms: float | None) -> float | None:
    return ms * 1e3 if ms is not None else None


def problem(record: dict[str, Any]) -> str:
    return str(record.get("error") or record.get("skipped") or "")


def table_lines(report: dict[str, Any]) -> list[str]:
    p = report.get("probe", {})
    lines = [f"probe: {p.get('name', p.get('device', '-'))}  D2D {fmt(p.get('d2d_gbps'))} GB/s  "
             f"H2D {fmt(p.get('h2d_gbps'))}  D2H {fmt(p.get('d2h_gbps'))}  {problem(p)}"]  # fmt: skip
    lines.append(f"q1 {'shape':<22} {'M':>4} {'us':>9} {'GB/s':>8} {'/B1':>6} {'xB2':>6} {'rel_err':>8}")
    for r in report.get("q1", {}).get("rows", []):
        lines.append(f"   {r['shape']:<22} {r.get('m', ''):>4} {fmt(micros(r.get('ours_ms'))):>9} "
                     f"{fmt(r.get('ours_gbps')):>8} {fmt(r.get('ours_over_b1'), '.2f'):>6} "
                     f"{fmt(r.get('speedup_vs_b2'), '.2f'):>6} {fmt(r.get('rel_err'), '.1e'):>8} "
                     f"{problem(r)}")  # fmt: skip
    lines.append(f"model {'name':<13} {'phase':<8} {'batch':>5} {'tok/s':>10} {'B2 tok/s':>10} {'xB2':>6}")
    for m in report.get("decode", {}).get("models", []):
        for r in m.get("results", [{"phase": "-", "batch": "-"}]):
            lines.append(f"      {m['model']:<13} {r['phase']:<8} {r['batch']:>5} "
                         f"{fmt(r.get('ours_tok_s')):>10} {fmt(r.get('b2_tok_s')):>10} "
                         f"{fmt(r.get('speedup_vs_b2'), '.2f'):>6} {problem(m) or problem(r)}")  # fmt: skip
    t = report.get("tier", {})
    pr, tt = t.get("promote", {}), t.get("ttft", {})
    lines.append(f"tier: promote {fmt(pr.get('promote_gbps'))} GB/s vs one large H2D "
                 f"{fmt(pr.get('large_h2d_gbps'))} ({fmt(pr.get('promote_over_large'), '.2f')}); "
                 f"TTFT cold {fmt(tt.get('cold_ttft_ms'))} ms, promoted {fmt(tt.get('promoted_ttft_ms'))} ms "
                 f"({fmt(tt.get('promoted_over_cold'), '.2f')}) "
                 f"{problem(pr)} {problem(tt)}")  # fmt: skip
    return lines


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (tests this script)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--models", nargs="+", choices=("1.7b", "8b"), default=["1.7b", "8b"],
                   help="GPU mode: which model shapes the q1 and decode sections use")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=330.0, help="skip what is left after this long")
    return p.parse_args()


def choose_plan(args: argparse.Namespace) -> Plan:
    if args.smoke:
        return SMOKE_PLAN
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --smoke for the CPU check")
    keep = {"1.7b": BONSAI_1P7B, "8b": BONSAI_8B}
    models = tuple(keep[name] for name in ("1.7b", "8b") if name in args.models)
    return dataclasses.replace(GPU_PLAN, models=models)


def main() -> None:
    args = parse_args()
    plan = choose_plan(args)
    # Fixed when @triton.jit decorates: set (or cleared) before any Triton kernel module is imported.
    if plan.device == "cuda":
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.manual_seed(SEED)
    report: dict[str, Any] = {"meta": {
        "mode": "smoke" if args.smoke else "gpu", "argv": sys.argv, "seed": SEED, "budget_s": args.budget_s,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"), "notes": NOTES,
    }}  # fmt: skip
    run_sections(args, plan, report)
    print("\n".join(table_lines(report)))
    print(f"wrote {args.out} in {report['meta'].get('elapsed_s', 0):.1f} s")


if __name__ == "__main__":
    main()

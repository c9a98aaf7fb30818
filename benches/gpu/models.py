"""The decode section: ``TorchQwen3.forward`` on random Bonsai-shaped weights over an fp16 ``KvPool``,
decode tokens/s per batch, eager and as CUDA graphs (``DecodeGraphs``; graph logits checked bit for bit
against eager ones), and prefill tokens/s, against B2 (the same model with fp16 dense weights)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oxibonsai.torch_backend.batch import BLOCK_TOKENS, DeviceBatch, StepBatch
from oxibonsai.torch_backend.graphs import DecodeGraphs
from oxibonsai.torch_backend.kv_pool import KvPool
from oxibonsai.torch_backend.model import TorchQwen3
from oxibonsai.torch_backend.ops import pdl, pdl_rows
from oxibonsai.torch_backend.ops.dispatch import OP_NAMES, ops_for
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight
from oxibonsai.torch_backend.weights import DenseWeight, LayerWeights, Qwen3Weights, fused_layer

from .kernels import kernel_times
from .plan import SEED, ModelSpec, Plan
from .q1 import dequantize_half, random_q1
from .timing import Budget, environment, free, guarded, ratio, sync


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
        return fused_layer(LayerWeights(norm(c.hidden), mat(c.q_dim, c.hidden), mat(c.kv_dim, c.hidden),
                            mat(c.kv_dim, c.hidden), mat(c.hidden, c.q_dim), norm(c.head_dim),
                            norm(c.head_dim), norm(c.hidden), mat(c.ffn, c.hidden), mat(c.ffn, c.hidden),
                            mat(c.hidden, c.ffn)))  # fmt: skip

    layers = tuple(layer() for _ in range(c.n_layers))
    output = None if spec.tied else mat(c.vocab, c.hidden)
    return Qwen3Weights(mat(c.vocab, c.hidden), layers, norm(c.hidden), output)


def half_dense(weights: Qwen3Weights) -> Qwen3Weights:
    """The same model with every matrix dequantized to fp16 (a tied head stays tied)."""

    def dense(w: Any) -> Any:
        return HalfDense(dequantize_half(w)) if isinstance(w, Q1Weight) else w

    unfused = [n for n in LayerWeights.__dataclass_fields__ if n not in ("wqkv", "w_gate_up")]
    layers = tuple(
        fused_layer(LayerWeights(**{name: dense(getattr(layer, name)) for name in unfused}))
        for layer in weights.layers
    )
    output = None if weights.output is None else dense(weights.output)
    return Qwen3Weights(dense(weights.token_embd), layers, weights.output_norm, output)


def streamed_bytes(weights: Qwen3Weights) -> int:
    """Matrix bytes one decode step reads: every layer's matrices and the LM head."""
    layers = sum(w.nbytes for layer in weights.layers for w in layer.matrices())
    return int(layers + weights.lm_head.nbytes)


# -- decode and prefill ----------------------------------------------------------------------------------


def decode_section(
    plan: Plan, device: torch.device, budget: Budget, tuned: Path | None = None
) -> dict[str, Any]:
    """Each model's decode and prefill rows; with ``tuned`` (a ``q1_tuned`` table), each also timed with
    the table's Q1 forms where it has one for the model's matrices (``graphs_tuned``, ``tuned_prefill``)."""
    ops = ops_for(device)
    models = []
    for spec in plan.models:
        if budget.over():
            models.append({"model": spec.name, **budget.skipped()})
            continue
        print(f"[{budget.spent():6.1f} s] decode {spec.name}", flush=True)
        record = partial(model_record, spec, plan, device, budget, ops, tuned)
        models.append(guarded(record, model=spec.name))
        free(device)
    return {"ops": {name: getattr(ops, name).__module__ for name in OP_NAMES}, "models": models}


def model_record(
    spec: ModelSpec, plan: Plan, device: torch.device, budget: Budget, ops: Any, tuned: Path | None
) -> dict:
    torch.manual_seed(SEED)
    weights = random_weights(spec, device)
    per_seq = blocks_for(plan.context + plan.warmup + plan.decode_steps + 1)
    pool = KvPool(spec.config.n_layers, max(plan.batches) * per_seq, spec.config.n_kv_heads,
                  spec.config.head_dim, torch.float16, device)  # fmt: skip
    pool.data.normal_()
    ours = run_phases(TorchQwen3(spec.config, weights, ops), pool, plan, device, budget, compare_pdl=True,
                      tuned=tuned)  # fmt: skip
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


PROFILED_STEPS = 3  # eager decode steps ``kernel_times`` profiles


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def run_phases(
    model: TorchQwen3, pool: KvPool, plan: Plan, device: torch.device, budget: Budget,
    compare_pdl: bool = False, tuned: Path | None = None,
) -> list:  # fmt: skip
    rng = np.random.default_rng(SEED)
    out = []
    for batch in plan.batches:
        label = {"phase": "decode", "batch": batch, "context": plan.context}
        if budget.over():
            out.append({**label, **budget.skipped()})
            continue
        rate = partial(decode_rate, model, pool, batch, plan, device, rng, compare_pdl, tuned)
        out.append(guarded(rate, **label))
    label = {"phase": "prefill", "batch": 1, "tokens": plan.prefill_tokens}
    out.append({**label, **budget.skipped()} if budget.over() else
               guarded(partial(prefill_rate, model, pool, plan, device, rng, tuned), **label))  # fmt: skip
    return out


def decode_rate(
    model: TorchQwen3, pool: KvPool, batch: int, plan: Plan, device: torch.device, rng: np.random.Generator,
    compare_pdl: bool, tuned: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Eager steps, then the same steps through ``DecodeGraphs`` (captured on CUDA; padded eager steps
    elsewhere), with the last step's logits compared bit for bit; with ``compare_pdl`` (our model),
    where the kernels can launch with PDL, the graphs once more the other way (``graphs_other_pdl``),
    at one row once more without the quantizations fused into the matmuls (``graphs_unfused``) and
    once with each other form of the split GEMV (``graphs_one_row_forms``), above 8 rows once with the
    decode kernel merging its splits (``graphs_merged``), once with the ``tuned``
    table's Q1 forms (``graphs_tuned``), and the device time per
    kernel of a few eager steps (``gpu.kernels``) with the share of a graph step it covers."""
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
    graphs = DecodeGraphs(model, pool, max_num_seqs=batch, max_model_len=per_seq * BLOCK_TOKENS,
                          capture=device.type == "cuda")  # fmt: skip
    graph_seconds = timed_calls([partial(graphs.run, p) for p in plans], plan.warmup, device)
    eager_logits = model.forward(batches[-1], pool)
    graph_logits = graphs.run(plans[-1])
    graph_tok_s = batch * plan.decode_steps / graph_seconds
    graph_step_us = graph_seconds / plan.decode_steps * 1e6
    other, kernels = {}, {}
    if compare_pdl:  # our model, not B2's
        args = (model, pool, plans, per_seq, plan.warmup, device, eager_logits, graph_tok_s)
        other = {
            **graphs_other_pdl(*args),
            **graphs_unfused(*args),
            **graphs_one_row_forms(*args),
            **graphs_merged(*args),
            **graphs_tuned(tuned, *args),
        }
        kernels = kernel_times(model, pool, batches[-PROFILED_STEPS:], device)
    return {"tok_s": batch * plan.decode_steps / seconds, "step_ms": seconds / plan.decode_steps * 1e3,
            "steps": plan.decode_steps, "graph_tok_s": graph_tok_s,
            "graph_step_ms": graph_step_us / 1e3,
            "graph_vs_eager": seconds / graph_seconds,
            "graph_captured": graphs.replays > 0,
            "graph_logits_equal": bool(torch.equal(graph_logits, eager_logits)),
            "graph_logits_max_abs_diff": float((graph_logits - eager_logits).abs().max()),
            "pdl": pdl.enabled(device) and batch <= pdl_rows.MAX_ROWS, **other, **kernels,
            "graph_busy_fraction": ratio(kernels.get("busy_us"), graph_step_us)}  # fmt: skip


def graphs_other_pdl(
    model: TorchQwen3, pool: KvPool, plans: list[StepBatch], per_seq: int, warmup: int, device: torch.device,
    eager_logits: torch.Tensor, graph_tok_s: float,
) -> dict[str, Any]:  # fmt: skip
    """Where the kernels can launch with PDL, the same graph steps captured the other way: with PDL off
    (``no_pdl_*``) where the step's rows get it by default (``pdl_rows``), on for every step
    (``all_pdl_*``, ``OXIBONSAI_PDL=all``) where they do not; their tok/s, whether the last step's
    logits are eager's bit for bit, and ``pdl_gain``: tok/s with PDL over tok/s without."""
    if not pdl.enabled(device):
        return {}
    default_on = plans[0].num_seqs <= pdl_rows.MAX_ROWS
    value = "0" if default_on else "all"
    tok_s, equal = graphs_under(pdl.ENV_VAR, value, model, pool, plans, per_seq, warmup, device, eager_logits)
    key = "no_pdl" if default_on else "all_pdl"
    with_pdl, without = (graph_tok_s, tok_s) if default_on else (tok_s, graph_tok_s)
    return {f"{key}_graph_tok_s": tok_s, f"{key}_logits_equal": equal, "pdl_gain": ratio(with_pdl, without)}


def graphs_unfused(
    model: TorchQwen3, pool: KvPool, plans: list[StepBatch], per_seq: int, warmup: int, device: torch.device,
    eager_logits: torch.Tensor, graph_tok_s: float,
) -> dict[str, Any]:  # fmt: skip
    """At one row, where the split GEMVs quantize their outputs for the next matmul (``ops.ahead``) and
    the attention's decode kernel does the QK-norm, RoPE and K/V write (``attn_triton.RopeKv``), the
    same graph steps with those in launches of their own (``OXIBONSAI_FUSE_QUANTIZE=0``,
    ``OXIBONSAI_FUSE_ROPE=0``): ``unfused_graph_tok_s``, whether the last step's logits are eager's
    bit for bit, and ``fuse_gain`` (tok/s fused over unfused; the kernel lines say which part is which)."""
    if plans[0].num_seqs != 1 or not model.quantizes_ahead:
        return {}
    from oxibonsai.torch_backend.ops import attn_triton, q1_exact

    args = (model, pool, plans, per_seq, warmup, device, eager_logits)
    with environment(attn_triton.FUSE_ROPE_ENV_VAR, "0"):
        tok_s, equal = graphs_under(q1_exact.FUSE_ENV_VAR, "0", *args)
    return {
        "unfused_graph_tok_s": tok_s,
        "unfused_logits_equal": equal,
        "fuse_gain": ratio(graph_tok_s, tok_s),
    }


def graphs_one_row_forms(
    model: TorchQwen3, pool: KvPool, plans: list[StepBatch], per_seq: int, warmup: int, device: torch.device,
    eager_logits: torch.Tensor, graph_tok_s: float,
) -> dict[str, Any]:  # fmt: skip
    """At one row, with the exact kernels, the same graph steps with each other form of the one-row
    GEMV whose K splits (``OXIBONSAI_ONE_ROW_GEMV``: over programs with a combine launch, "gemv", or
    combined by each tile's last program, "gemv_fixup"): per form its tok/s, whether the last step's
    logits are eager's bit for bit, and its tok/s over the default's (``one_row_forms``)."""
    if plans[0].num_seqs != 1 or not model.quantizes_ahead:
        return {}
    from oxibonsai.torch_backend.ops import q1_exact

    forms = {}
    for kernel in q1_exact.ONE_ROW_KERNELS:
        if kernel == q1_exact.one_row_gemv():
            continue
        args = (model, pool, plans, per_seq, warmup, device, eager_logits)
        tok_s, equal = graphs_under(q1_exact.ONE_ROW_ENV_VAR, kernel, *args)
        forms[kernel] = {"graph_tok_s": tok_s, "logits_equal": equal,
                         "over_default": ratio(tok_s, graph_tok_s)}  # fmt: skip
    return {"one_row_default": q1_exact.one_row_gemv(), "one_row_forms": forms}


def graphs_merged(
    model: TorchQwen3, pool: KvPool, plans: list[StepBatch], per_seq: int, warmup: int, device: torch.device,
    eager_logits: torch.Tensor, graph_tok_s: float,
) -> dict[str, Any]:  # fmt: skip
    """Above ``attn_triton.MERGE_MAX_ROWS`` rows, with the exact kernels, the same graph steps with the
    decode kernel merging its own splits (``OXIBONSAI_FUSE_MERGE=all``; by default a merge launch does
    there): ``merged_graph_tok_s``, whether the last step's logits are eager's bit for bit, and
    ``merge_gain`` (tok/s merged in the kernel over the default's), for choosing the limit."""
    from oxibonsai.torch_backend.ops import attn_triton

    rows = plans[0].num_seqs
    if not model.quantizes_ahead or rows <= attn_triton.MERGE_MAX_ROWS:
        return {}
    with environment(attn_triton.FUSE_MERGE_ENV_VAR, "all"):
        if not attn_triton.merges_in_decode(rows, model.config.n_kv_heads):
            return {}
    args = (model, pool, plans, per_seq, warmup, device, eager_logits)
    tok_s, equal = graphs_under(attn_triton.FUSE_MERGE_ENV_VAR, "all", *args)
    return {
        "merged_graph_tok_s": tok_s,
        "merged_logits_equal": equal,
        "merge_gain": ratio(tok_s, graph_tok_s),
    }


def graphs_tuned(
    tuned: Path | None, model: TorchQwen3, pool: KvPool, plans: list[StepBatch], per_seq: int, warmup: int,
    device: torch.device, eager_logits: torch.Tensor, graph_tok_s: float,
) -> dict[str, Any]:  # fmt: skip
    """Where the ``tuned`` table (``q1_tuned``) picks a form for one of the model's matrices at this
    batch's rows, the same graph steps with its forms (``OXIBONSAI_Q1_TUNED``): ``tuned_graph_tok_s``,
    whether the last step's logits are eager's bit for bit (every form gives the same bits), and
    ``tuned_gain`` (tok/s tuned over the defaults')."""
    forms = {} if tuned is None else tuned_forms(tuned, model, plans[0].num_seqs, device)
    if not forms:
        return {}
    from oxibonsai.torch_backend.ops import q1_tuned

    args = (model, pool, plans, per_seq, warmup, device, eager_logits)
    tok_s, equal = graphs_under(q1_tuned.ENV_VAR, str(tuned), *args)
    return {
        "tuned_forms": forms,
        "tuned_graph_tok_s": tok_s,
        "tuned_logits_equal": equal,
        "tuned_gain": ratio(tok_s, graph_tok_s),
    }


def tuned_forms(tuned: Path, model: TorchQwen3, rows: int, device: torch.device) -> dict[str, str]:
    """The ``tuned`` table's kernel for each of the model's matrices it has a choice for at ``rows``."""
    from oxibonsai.torch_backend.ops import q1_tuned

    c = model.config
    shapes = {"qkv": (c.q_dim + 2 * c.kv_dim, c.hidden, False), "o": (c.hidden, c.q_dim, False),
              "gate_up": (c.ffn, c.hidden, True), "down": (c.hidden, c.ffn, False)}  # fmt: skip
    out = {}
    with environment(q1_tuned.ENV_VAR, str(tuned)):
        for role, (out_rows, cols, gated) in shapes.items():
            options = q1_tuned.choice(device, rows, out_rows, cols, gated)
            if options is not None:
                out[role] = "/".join(str(v) for v in options.values() if v is not None)
    return out


def graphs_under(
    env_var: str, value: str, model: TorchQwen3, pool: KvPool, plans: list[StepBatch], per_seq: int,
    warmup: int, device: torch.device, eager_logits: torch.Tensor,
) -> tuple[float, bool]:  # fmt: skip
    """The decode steps ``plans`` through graphs captured with ``env_var=value``: tok/s, and whether
    the last step's logits are ``eager_logits`` bit for bit."""
    with environment(env_var, value):
        graphs = DecodeGraphs(
            model,
            pool,
            max_num_seqs=plans[0].num_seqs,
            max_model_len=per_seq * BLOCK_TOKENS,
            capture=device.type == "cuda",
        )
        seconds = timed_calls([partial(graphs.run, p) for p in plans], warmup, device)
        logits = graphs.run(plans[-1])
    return plans[0].num_seqs * (len(plans) - warmup) / seconds, bool(torch.equal(logits, eager_logits))


def prefill_rate(
    model: TorchQwen3, pool: KvPool, plan: Plan, device: torch.device, rng: np.random.Generator,
    tuned: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Eager prefill of ``plan.prefill_tokens``; where the ``tuned`` table has forms for the model's
    matrices at that many rows, again with them (``tuned_tok_s``, ``tuned_logits_equal``,
    ``tuned_gain``)."""
    tokens = rng.integers(model.config.vocab, size=plan.prefill_tokens).tolist()
    table = rng.permutation(pool.num_blocks)[: blocks_for(plan.prefill_tokens)].tolist()
    batch = StepBatch.for_sequences([(table, 0, tokens, "last")]).to_device(device)
    reps = max(1, plan.reps // 3)
    seconds = timed_forwards(model, pool, [batch] * (plan.warmup + reps), plan.warmup, device) / reps
    out = {"tok_s": plan.prefill_tokens / seconds, "step_ms": seconds * 1e3, "steps": reps}
    forms = {} if tuned is None else tuned_forms(tuned, model, plan.prefill_tokens, device)
    if forms:
        from oxibonsai.torch_backend.ops import q1_tuned

        logits = model.forward(batch, pool)
        with environment(q1_tuned.ENV_VAR, str(tuned)):
            tuned_s = timed_forwards(model, pool, [batch] * (plan.warmup + reps), plan.warmup, device) / reps
            same = bool(torch.equal(model.forward(batch, pool), logits))
        out |= {"tuned_forms": forms,
                "tuned_tok_s": plan.prefill_tokens / tuned_s, "tuned_logits_equal": same,
                "tuned_gain": ratio(seconds, tuned_s)}  # fmt: skip
    return out


def timed_forwards(
    model: TorchQwen3, pool: KvPool, batches: list[DeviceBatch], warmup: int, device: torch.device
) -> float:
    """Seconds for ``batches[warmup:]``, run back to back after the first ``warmup``."""
    return timed_calls([partial(model.forward, batch, pool) for batch in batches], warmup, device)


def timed_calls(calls: list[Callable[[], object]], warmup: int, device: torch.device) -> float:
    """Seconds for ``calls[warmup:]``, run back to back after the first ``warmup``."""
    for call in calls[:warmup]:
        call()
    sync(device)
    start = time.perf_counter()
    for call in calls[warmup:]:
        call()
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
               "speedup_vs_b2": ratio(r.get("tok_s"), other.get("tok_s")),
               "b2_graph_tok_s": other.get("graph_tok_s"),
               "graph_speedup_vs_b2": ratio(r.get("graph_tok_s"), other.get("graph_tok_s"))}  # fmt: skip
        if "error" in other or "skipped" in other:
            row["b2_error"] = other.get("error") or other.get("skipped")
        if r["phase"] == "decode" and r["batch"] == 1 and r.get("tok_s"):
            row["weight_gbps"] = streamed * max(r["tok_s"], r.get("graph_tok_s") or 0) / 1e9
        out.append(row)
    return out

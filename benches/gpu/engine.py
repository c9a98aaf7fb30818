"""The engine section: what a user of ``oxibonsai.LLM(device="cuda")`` sees, end to end, on a random
Bonsai-1.7B-shaped GGUF (a tiny one in the smoke run): greedy decode tokens/s of one request and of
16 and 64 concurrent ones, with CUDA graphs and steps launched ahead of their tokens (the defaults),
eagerly (``enforce_eager=True``), with graphs over the float Q1 kernels
(``OXIBONSAI_Q1_ARITHMETIC=float``), with graphs but each step planned after the last one's tokens
(``OXIBONSAI_ASYNC_SCHEDULING=0``: ``ahead_gain``), and that with each step's output work after its
tokens too instead of overlapping the next step (``OXIBONSAI_ASYNC_OUTPUT=0``: ``overlap_gain``), the
same prompts in all five; sampling on the device in all (the default on CUDA; the smoke run's too).
The modes run in ``MODES`` order, and one that would start after the bench's budget is spent is
skipped (``skipped_modes``; its comparisons are None), so the section's figures are written before the
device command's time runs out.
Batch ``n`` runs the first ``n`` prompts of the largest batch, so each row says whether graphs and
eager gave the same tokens and whether each request's tokens equal those it got in the largest batch
(batched vs alone: ``batch_invariant``; the exact arithmetic promises it, the float one does not).
Tokens/s counts generated tokens over the wall time of ``generate`` after a warm-up, so it includes
the prefill of each batch's prompts, the scheduler, sampling and detokenization."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import oxibonsai
from oxibonsai.torch_backend.ops.dispatch import Q1_ENV_VAR

from .plan import SEED, Plan
from .tier import import_tests_module
from .timing import Budget, environment, free, ratio

PROMPT_TOKENS = 32


MODES = ("graphs", "planned_after", "eager", "output_after", "float")
"""In the order they run: the default first, then what each comparison needs, most telling first."""


def engine_section(plan: Plan, device: torch.device, budget: Budget) -> dict[str, Any]:
    """The section's figures; a mode that would start once ``budget`` is spent is skipped (its
    figures are missing from the rows), so the section never runs far past the bench's budget."""
    factory = import_tests_module("model_factory")
    cfg = factory.bonsai_1p7b_config() if device.type == "cuda" else factory.TinyQwen3Config()
    path = Path(tempfile.mkdtemp(prefix="bench-gpu-")) / "engine.gguf"
    factory.write_qwen3_gguf(path, cfg, np.random.default_rng(SEED + 1))
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(cfg.vocab_size, size=PROMPT_TOKENS).tolist() for _ in range(max(plan.batches))]
    batches = {n: prompts[:n] for n in plan.batches}
    runs: dict[str, Any] = {}
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    skipped = []
    try:
        for mode in MODES:
            if mode != MODES[0] and budget.over():
                skipped.append(mode)
                continue
            with (
                arithmetic("float" if mode == "float" else "exact"),
                switches(ahead=mode not in ("planned_after", "output_after"), overlap=mode != "output_after"),
            ):
                llm = load(path, plan, max(plan.batches), eager=mode == "eager")
            runs[mode], tokens[mode] = decode_runs(llm, batches, plan)
            graphs = getattr(llm._runner, "graphs", None)
            runs[mode]["graph_replays"] = graphs.replays if graphs is not None else 0
            if mode == "graphs":
                runs["vs_native_cpu"] = against_native(llm, path, batches[min(batches)][0])
            del llm
            free(device)
    finally:
        path.unlink()
    rows = [engine_row(n, runs, tokens) for n in plan.batches]
    return {"gguf": cfg.name, "prompt_tokens": PROMPT_TOKENS, "decode_tokens": plan.engine_tokens,
            "graph_replays": runs["graphs"]["graph_replays"], "rows": rows,
            "vs_native_cpu": runs["vs_native_cpu"], "skipped_modes": skipped}  # fmt: skip


def engine_row(n: int, runs: dict[str, Any], tokens: dict[str, dict[int, list[list[int]]]]) -> dict[str, Any]:
    """Batch ``n``'s figures from the modes that ran (a comparison with a skipped mode is None)."""
    largest = max(tokens["graphs"])

    def rate(mode: str) -> float | None:
        return runs[mode][n]["tok_s"] if mode in runs else None

    def gain(mode: str, over: str) -> float | None:
        return ratio(rate(mode), rate(over))

    def same(mode: str, other: str) -> bool | None:
        return tokens[mode][n] == tokens[other][n] if mode in tokens and other in tokens else None

    def invariant(mode: str) -> bool | None:
        return tokens[mode][n] == tokens[mode][largest][:n] if mode in tokens else None

    eager_invariant = invariant("eager")
    return {"batch": n, "graph_tok_s": rate("graphs"), "eager_tok_s": rate("eager"),
            "graph_over_eager": gain("graphs", "eager"), "float_graph_tok_s": rate("float"),
            "planned_after_tok_s": rate("planned_after"), "ahead_gain": gain("graphs", "planned_after"),
            "ahead_same_tokens": same("graphs", "planned_after"),
            "output_after_tok_s": rate("output_after"), "overlap_gain": gain("planned_after", "output_after"),
            "overlap_same_tokens": same("planned_after", "output_after"),
            "exact_over_float": gain("graphs", "float"), "same_tokens": same("graphs", "eager"),
            "batch_invariant": invariant("graphs") and eager_invariant is not False,
            "float_batch_invariant": invariant("float")}  # fmt: skip


def arithmetic(name: str) -> AbstractContextManager[None]:
    """``OXIBONSAI_Q1_ARITHMETIC`` set while a model loads (the op set is chosen then)."""
    return environment(Q1_ENV_VAR, name)


@contextmanager
def switches(*, ahead: bool, overlap: bool) -> Iterator[None]:
    """The runner's switches while it is made (it reads them then): device sampling,
    ``OXIBONSAI_ASYNC_SCHEDULING`` (steps launched ahead) and ``OXIBONSAI_ASYNC_OUTPUT`` (the overlap)."""
    flag = {True: "1", False: "0"}
    with (
        environment("OXIBONSAI_DEVICE_SAMPLING", "1"),
        environment("OXIBONSAI_ASYNC_SCHEDULING", flag[ahead]),
        environment("OXIBONSAI_ASYNC_OUTPUT", flag[overlap]),
    ):
        yield


def load(path: Path, plan: Plan, max_batch: int, *, eager: bool) -> oxibonsai.LLM:
    return oxibonsai.LLM(
        str(path), device=plan.device, runner="torch", max_model_len=PROMPT_TOKENS + plan.engine_tokens + 16,
        max_num_seqs=max_batch, kv_cache_dtype="f16", enable_prefix_caching=False, enforce_eager=eager,
    )  # fmt: skip


def decode_runs(
    llm: oxibonsai.LLM, batches: dict[int, list[list[int]]], plan: Plan
) -> tuple[dict[Any, Any], dict[int, list[list[int]]]]:
    """Per batch size: tokens/s of a timed ``generate`` after an untimed one, and its tokens."""
    params = oxibonsai.SamplingParams(max_tokens=plan.engine_tokens, temperature=0.0, ignore_eos=True)
    rates: dict[Any, Any] = {}
    tokens: dict[int, list[list[int]]] = {}
    for n, prompts in batches.items():
        requests = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(requests, params, use_tqdm=False)  # warm-up: compiles and captures every bucket
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens[n] = [o.outputs[0].token_ids for o in outs]
        rates[n] = {"tok_s": sum(len(t) for t in tokens[n]) / seconds, "seconds": seconds}
    return rates, tokens


def against_native(llm: oxibonsai.LLM, path: Path, ids: list[int]) -> dict[str, Any]:
    """The torch runner's logits of ``ids`` against the native CPU runner's on the same file."""
    native = oxibonsai.LLM(str(path), runner="native", device="cpu", max_model_len=len(ids) + 16,
                           kv_cache_dtype="f32")  # fmt: skip
    ours, cpu = llm.logits(ids).astype(np.float64), native.logits(ids).astype(np.float64)
    rel = np.linalg.norm(ours - cpu, axis=1) / np.linalg.norm(cpu, axis=1)
    return {"tokens": len(ids), "median_rel_l2": float(np.median(rel)), "max_rel_l2": float(rel.max()),
            "top1_agreement": float(np.mean(ours.argmax(axis=1) == cpu.argmax(axis=1))),
            "max_abs_diff": float(np.abs(ours - cpu).max())}  # fmt: skip

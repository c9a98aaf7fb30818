"""The tier section: promote and demote GB/s of scattered KV blocks against one large pinned copy, and,
through ``oxibonsai.LLM(runner="torch")`` on a random GGUF, the TTFT of a request whose prefix was
demoted to the host tier against a cold prefill and a device hit; then, with the prefetch of host-tier
prefixes on and off (two engines, ``OXIBONSAI_HOST_PREFETCH``, rounds interleaved), the same request
queued behind a prompt that fills a step, and arriving while other requests decode (its time to first
token and the tokens the others got meanwhile)."""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

import oxibonsai
from oxibonsai.torch_backend.batch import BLOCK_TOKENS
from oxibonsai.torch_backend.kv_pool import KvPool, copy_blocks

from .models import blocks_for
from .plan import SEED, Plan
from .timing import Budget, free, gbps, guarded, ratio, wall_ms

TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"
ROUND_COUNTERS = ("promotions", "demotions", "host_hit_tokens", "computed_tokens")  # cache_stats per round


def tier_section(plan: Plan, device: torch.device, budget: Budget) -> dict[str, Any]:
    promote = guarded(partial(promote_record, plan, device))
    free(device)
    start = time.perf_counter()
    gguf = random_gguf(device, "tier.gguf")  # one file for the engines of both records
    written = time.perf_counter() - start
    try:
        ttft = budget.skipped() if budget.over() else guarded(partial(ttft_record, plan, gguf))
        free(device)
        prefetch = budget.skipped() if budget.over() else guarded(partial(prefetch_record, plan, gguf))
        free(device)
    finally:
        gguf[0].unlink()
    return {"promote": promote, "gguf_write_s": written, "ttft": ttft, "prefetch": prefetch}


def promote_record(plan: Plan, device: torch.device) -> dict[str, Any]:
    c, n, cuda = plan.models[0].config, plan.promote_blocks, device.type == "cuda"
    host = KvPool(
        c.n_layers, 4 * n, c.n_kv_heads, c.head_dim, torch.float16, "cpu", pin=cuda, block_major=True
    )
    dev = KvPool(c.n_layers, 2 * n, c.n_kv_heads, c.head_dim, torch.float16, device)
    rng = np.random.default_rng(SEED)
    pairs = np.stack([rng.choice(4 * n, n, replace=False), rng.choice(2 * n, n, replace=False)], axis=1)
    src = torch.from_numpy(pairs[:, 0].copy())
    expected = torch.randn(host.data[src].shape).to(torch.float16)  # block-major [n, layers, 2, ...]
    host.data.index_copy_(0, src, expected)
    promote = wall_ms(lambda: copy_blocks(host, dev, pairs), device, plan.warmup, plan.reps)
    moved = dev.blocks(torch.from_numpy(pairs[:, 1].copy()).to(device)).permute(2, 0, 1, 3, 4, 5).cpu()
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


def random_gguf(device: torch.device, name: str) -> tuple[Path, Any]:
    """A random GGUF of Bonsai-1.7B's shapes on CUDA (the tiny test model elsewhere), and its config."""
    factory = import_tests_module("model_factory")
    cfg = factory.bonsai_1p7b_config() if device.type == "cuda" else factory.TinyQwen3Config()
    path = Path(tempfile.mkdtemp(prefix="bench-gpu-")) / name
    factory.write_qwen3_gguf(path, cfg, np.random.default_rng(SEED))
    return path, cfg


def ttft_record(plan: Plan, gguf: tuple[Path, Any]) -> dict[str, Any]:
    path, cfg = gguf
    start = time.perf_counter()
    prompt = plan.ttft_prefix + plan.ttft_tail
    run = TtftRun(load_ttft_llm(path, plan, prompt), prompt, cfg.vocab_size, np.random.default_rng(SEED))
    loaded = time.perf_counter()
    warm_ttft(run, plan)
    rounds = [ttft_round(run, plan) for _ in range(plan.ttft_repeats)]
    cold = statistics.median(r["cold_ms"] for r in rounds)
    promoted = statistics.median(r["promoted_ms"] for r in rounds)
    stats = run.llm.cache_stats()
    prefix_blocks = plan.ttft_prefix // BLOCK_TOKENS
    return {
        "gguf": cfg.name, "load_s": loaded - start,
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


def prefetch_record(plan: Plan, gguf: tuple[Path, Any]) -> dict[str, Any]:
    """TTFT of a request whose prefix sits in the host tier, queued behind a prompt that takes a whole
    step (both arrive together), with the prefetch of its prefix on and off."""
    path, cfg = gguf
    prompt = plan.ttft_prefix + plan.ttft_tail
    runs = {flag: prefetch_run(path, plan, prompt, cfg.vocab_size, flag) for flag in ("1", "0")}
    for run in runs.values():  # warm-up: every path compiled outside the timed rounds
        queued_round(run, plan)
        arrival_round(run, plan)
    rounds: dict[str, list[dict[str, Any]]] = {flag: [] for flag in runs}
    for _ in range(plan.ttft_repeats):
        for flag, run in runs.items():
            rounds[flag].append({**queued_round(run, plan), **arrival_round(run, plan)})
    on, off = (statistics.median(r["queued_ms"] for r in rounds[f]) for f in ("1", "0"))
    arrival = {
        f"arrival_{key}_{name}": statistics.median(r[f"arrival_{key}"] for r in rounds[flag])
        for flag, name in (("1", "prefetch"), ("0", "no_prefetch"))
        for key in ("ttft_ms", "decoder_tokens", "steps")
    }
    prefix_blocks = plan.ttft_prefix // BLOCK_TOKENS
    return {
        "gguf": cfg.name, "prefix_tokens": plan.ttft_prefix, "tail_tokens": plan.ttft_tail,
        "ahead_prompt_tokens": prompt + 16, "max_num_batched_tokens": prompt + 16,
        "queued_ttft_prefetch_ms": on, "queued_ttft_no_prefetch_ms": off,
        "prefetch_over_no_prefetch": ratio(on, off),
        "ahead_ttft_prefetch_ms": statistics.median(r["ahead_ms"] for r in rounds["1"]),
        "ahead_ttft_no_prefetch_ms": statistics.median(r["ahead_ms"] for r in rounds["0"]),
        **arrival, "arrival_decoders": ARRIVAL_DECODERS,
        "all_prefixes_prefetched": all(r["prefetched_blocks"] >= prefix_blocks for r in rounds["1"]),
        "none_prefetched_when_off": all(r["prefetched_blocks"] == 0 for r in rounds["0"]),
        "arrivals_prefetched": all(r["arrival_prefetched_blocks"] >= prefix_blocks for r in rounds["1"]),
        # Both engines see the same prompts (same seed): prefetched KV must give the promoted KV's tokens.
        "same_tokens": [r["tokens"] for r in rounds["1"]] == [r["tokens"] for r in rounds["0"]],
        "rounds": rounds,
    }  # fmt: skip


def prefetch_run(path: Path, plan: Plan, prompt: int, vocab: int, flag: str) -> TtftRun:
    """An engine that fits a step-filling prompt (or a few short decoding requests) beside a promoted
    prefix, with ``OXIBONSAI_HOST_PREFETCH`` set to ``flag`` while it is built."""
    per_prompt = blocks_for(prompt + 17)
    before = os.environ.get("OXIBONSAI_HOST_PREFETCH")
    os.environ["OXIBONSAI_HOST_PREFETCH"] = flag
    try:
        llm = oxibonsai.LLM(
            str(path), device=plan.device, runner="torch", max_model_len=prompt + 32, max_num_seqs=8,
            max_num_batched_tokens=prompt + 16, kv_cache_dtype="f16", kv_cache_blocks=3 * per_prompt + 4,
            host_kv_cache_blocks=8 * per_prompt,
        )  # fmt: skip
    finally:
        if before is None:
            del os.environ["OXIBONSAI_HOST_PREFETCH"]
        else:
            os.environ["OXIBONSAI_HOST_PREFETCH"] = before
    return TtftRun(llm, prompt, vocab, np.random.default_rng(SEED))


def queued_round(run: TtftRun, plan: Plan) -> dict[str, Any]:
    """A prefix cached, pushed out to the host tier, then asked for again behind a prompt that fills
    the first step: the queued request starts in the second step."""
    prefix = run.ids(plan.ttft_prefix)
    run.request(prefix + run.ids(plan.ttft_tail))
    run.fill()
    before = run.llm.cache_stats()["prefetched_blocks"]
    params = oxibonsai.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ahead = {"prompt_token_ids": run.ids(run.prompt_tokens + 16)}
    queued = {"prompt_token_ids": prefix + run.ids(plan.ttft_tail)}
    outs = run.llm.generate([ahead, queued], params)
    ttft = [o.metrics.time_to_first_token for o in outs]
    assert None not in ttft
    return {
        "ahead_ms": ttft[0] * 1e3,
        "queued_ms": ttft[1] * 1e3,
        "prefetched_blocks": run.llm.cache_stats()["prefetched_blocks"] - before,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


ARRIVAL_DECODERS = 4


def arrival_round(run: TtftRun, plan: Plan) -> dict[str, Any]:
    """A prefix cached and pushed out to the host tier; then, while ``ARRIVAL_DECODERS`` short requests
    decode, a request for it arrives: the ms and steps to its first token, and how many tokens the
    decoders got meanwhile (with the prefetch, it starts a step later and the decoders do not wait for
    its copies)."""
    prefix = run.ids(plan.ttft_prefix)
    run.request(prefix + run.ids(plan.ttft_tail))
    run.fill()
    engine = run.llm._engine
    long = oxibonsai.SamplingParams(max_tokens=run.prompt_tokens + 16, temperature=0.0, ignore_eos=True)
    decoders = [f"decoder-{i}" for i in range(ARRIVAL_DECODERS)]
    for rid in decoders:
        engine.add_request(rid, None, run.ids(8), long)
    for _ in range(3):
        engine.step()  # the decoders' prompts, then decodes
    tokens_before = sum(r.metrics.num_generated_tokens for r in engine._requests.values())
    before = run.llm.cache_stats()["prefetched_blocks"]
    one = oxibonsai.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("arrival", None, prefix + run.ids(plan.ttft_tail), one)
    steps = 0
    while "arrival" in engine._handles:
        engine.step()
        steps += 1
    elapsed = (time.perf_counter() - start) * 1e3
    tokens = sum(r.metrics.num_generated_tokens for r in engine._requests.values()) - tokens_before
    for rid in decoders:
        engine.abort(rid)
    return {
        "arrival_ttft_ms": elapsed, "arrival_steps": steps, "arrival_decoder_tokens": tokens,
        "arrival_prefetched_blocks": run.llm.cache_stats()["prefetched_blocks"] - before,
    }  # fmt: skip

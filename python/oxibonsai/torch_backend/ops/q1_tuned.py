"""Measured choices of the exact Q1 matmul's form, per GPU: which kernel, K split, tile width and dot
depth (``q1_exact.linear_quantized``'s options) to use for a matrix shape at a number of activation
rows, where the GPU bench's q1 sweep found one faster than the defaults. Every form gives the same
bits, so a table changes speed only, never tokens.

A table is JSON: ``{"device": "NVIDIA H200", "triton": "3.6.0", "choices": [{"rows": ..., "cols": ...,
"gated": ..., "m": ..., "options": {...}, "ms": ..., "default_ms": ...}, ...]}`` (``rows``: output
rows, a gate|up matrix's half; ``cols``: K). ``benches/bench_gpu.py`` writes one from its sweep
(``choices_from_sweep``); a device's shipped table sits in ``tuned/`` under the device's name
(``table_file``). ``OXIBONSAI_Q1_TUNED`` names another table's file, or ``0`` for none.

A matmul of ``m`` rows takes the choice measured at the largest swept ``m' <= m`` on the same side of
``q1_exact.GEMV_MAX_M`` (GEMV or GEMM), where that form takes ``m`` rows; otherwise the defaults. An
explicit one-row form (``OXIBONSAI_ONE_ROW_GEMV``) wins at one row."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

ENV_VAR = "OXIBONSAI_Q1_TUNED"
TABLES_DIR = Path(__file__).resolve().parent / "tuned"
OPTION_NAMES = ("kernel", "split_k", "block_n", "group_dot")
MIN_GAIN = 1.03  # a form enters a table only this much faster than the defaults (timing noise)

Choices = dict[tuple[int, int, bool], list[tuple[int, dict[str, Any]]]]  # (rows, cols, gated) -> (m, options)


def table_file(device_name: str) -> Path:
    """The shipped table of the GPU named ``device_name`` (``torch.cuda.get_device_name``)."""
    return TABLES_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def choice(device: torch.device, m: int, rows: int, cols: int, gated: bool) -> dict[str, Any] | None:
    """The measured options for ``m`` activation rows of a ``rows x cols`` matrix (see the module doc),
    or None for the defaults."""
    from oxibonsai.torch_backend.ops import q1_exact

    if m == 1 and os.environ.get(q1_exact.ONE_ROW_ENV_VAR, "").strip():
        return None
    measured = _choices(_table_path(device)).get((rows, cols, gated), [])
    gemv = m <= q1_exact.GEMV_MAX_M
    below = [(at, options) for at, options in measured if at <= m and (at <= q1_exact.GEMV_MAX_M) == gemv]
    if not below:
        return None
    options = max(below, key=lambda measured_at: measured_at[0])[1]
    return options if takes(options, m, gated) else None


def takes(options: dict[str, Any], m: int, gated: bool) -> bool:
    """Whether ``linear_quantized`` takes these options at ``m`` activation rows."""
    from oxibonsai.torch_backend.ops import q1_exact

    kernel = options.get("kernel") or ""
    block_n = options.get("block_n")
    if kernel.startswith("gemm"):
        return block_n is None or block_n in q1_exact.gemm_block_ns(gated)
    most = {"gemv_split": 1, "gemv_fixup": q1_exact.FIXUP_MAX_M, "gemv": q1_exact.GEMV_MAX_M}.get(kernel, 0)
    if kernel == "gemv_split" and block_n is not None:
        return False
    return m <= most and (block_n is None or block_n in q1_exact.gemv_block_ns(m, gated))


def _table_path(device: torch.device) -> str | None:
    named = os.environ.get(ENV_VAR, "").strip()
    if named:
        return None if named == "0" else named
    if device.type != "cuda":
        return None
    return _shipped_table(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _shipped_table(index: int) -> str:
    """The shipped table's path for CUDA device ``index`` (named once per device: every matmul asks)."""
    return str(table_file(torch.cuda.get_device_name(index)))


@functools.cache
def _choices(path: str | None) -> Choices:
    """The table at ``path`` by matrix shape (nothing for None or a missing file; a bad one raises)."""
    if path is None or not os.path.exists(path):
        return {}
    with open(path) as f:
        table = json.load(f)
    out: Choices = {}
    for entry in table.get("choices", []):
        options = {name: entry["options"][name] for name in OPTION_NAMES if name in entry["options"]}
        if not options.get("kernel"):
            raise ValueError(f"{path}: a choice without a kernel: {entry}")
        key = (int(entry["rows"]), int(entry["cols"]), bool(entry["gated"]))
        out.setdefault(key, []).append((int(entry["m"]), options))
    return out


def choices_from_sweep(cases: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A table's choices from the q1 section's cases: each swept case whose fastest form beat the
    defaults (its ``sweep_ms["default"]``) by ``MIN_GAIN``."""
    out = []
    for case in cases:
        times, forms = case.get("sweep_ms") or {}, case.get("sweep_options") or {}
        default = times.get("default")
        timed = [(ms, label) for label, ms in times.items() if label in forms and ms is not None]
        if not default or not timed:
            continue
        ms, label = min(timed)
        if ms * MIN_GAIN <= default:
            rows = case["rows"] // 2 if case["gated"] else case["rows"]
            out.append({"rows": rows, "cols": case["cols"], "gated": case["gated"], "m": case["m"],
                        "form": label, "options": forms[label], "ms": ms, "default_ms": default})  # fmt: skip
    return out

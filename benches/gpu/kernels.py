"""Where a decode step's device time goes: the decode section's per-kernel breakdown.

``kernel_times`` runs a few eager decode steps under ``torch.profiler`` and adds up, per kernel name,
the device time and launches per step (the top ``TOP`` by time), and their sum, ``busy_us``. Beside the
CUDA-graph step time it says how much of a step is kernels and how much is the gaps between them, and
which kernels to work on next; ``per_matmul`` splits the Q1 matmuls' time by the matrix they multiply
(a layer's QKV, O, gate|up and down, and the LM head). PDL is off while profiling: with it a kernel
starts before the one ahead of it ends and waits, so its span would hold the other's work too. Off
CUDA it profiles the CPU ops instead (the smoke run's check that the plumbing works; nested ops count
twice there)."""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch

from oxibonsai.torch_backend.batch import DeviceBatch
from oxibonsai.torch_backend.kv_pool import KvPool
from oxibonsai.torch_backend.model import TorchQwen3
from oxibonsai.torch_backend.ops import pdl

from .timing import environment, sync

TOP = 12  # kernels listed per step, by device time
MATMULS = {"_gemv_kernel", "_gemv_split_kernel", "_gemm_kernel", "_fast_gemv_kernel"}  # one per Q1 matmul
FOLLOWERS = {"_combine_kernel", "_epilogue_kernel"}  # a split matmul's second launch
ROLES = ("qkv", "o", "gate_up", "down")  # each layer's Q1 matmuls in launch order (the LM head last)


def kernel_times(model: TorchQwen3, pool: KvPool, batches: list[DeviceBatch], device: torch.device) -> dict:
    """``{"kernels": [...], "busy_us": ...}`` over ``batches`` (one eager step each, after one unprofiled
    step), or ``{"kernels_error": ...}``: a failure here never costs the decode row its other figures."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    try:
        with environment(pdl.ENV_VAR, "0"):
            model.forward(batches[0], pool)
            sync(device)
            with profile(activities=[activity]) as prof:
                for batch in batches:
                    model.forward(batch, pool)
                sync(device)
        kind = "CUDA" if cuda else "CPU"
        return {**per_step(prof.events(), kind, len(batches)),
                **per_matmul(prof.events(), kind, len(batches), model.config.n_layers)}  # fmt: skip
    except Exception as e:  # recorded beside the row's other figures
        return {"kernels_error": f"{type(e).__name__}: {e}", "kernels_traceback": traceback.format_exc()}


def per_step(events: Any, kind: str, steps: int) -> dict[str, Any]:
    """The events of device type ``kind`` (``torch.autograd.DeviceType`` name) added up by name: per
    step, microseconds and launches, the ``TOP`` largest, and the sum over all of them."""
    time_us: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    for event in events:
        if str(event.device_type).rsplit(".", 1)[-1] != kind:
            continue
        time_us[event.name] += event.time_range.elapsed_us()
        launches[event.name] += 1
    top = [{"name": name, "us": us / steps, "launches": launches[name] / steps}
           for name, us in time_us.most_common(TOP)]  # fmt: skip
    return {"kernels": top, "busy_us": sum(time_us.values()) / steps,
            "launches_per_step": sum(launches.values()) / steps}  # fmt: skip


def per_matmul(events: Any, kind: str, steps: int, layers: int) -> dict[str, Any]:
    """The Q1 matmuls' device time per step by matrix role (``{"matmuls": {role: us}}``), from the
    launch order: each layer's ``ROLES``, then the LM head; a ``FOLLOWERS`` launch counts with the
    matmul before it. Empty when the launches do not follow that order (another model layout)."""
    ordered = sorted((e for e in events if str(e.device_type).rsplit(".", 1)[-1] == kind),
                     key=lambda e: e.time_range.start)  # fmt: skip
    roles = [*ROLES * layers, "head"]
    us: Counter[str] = Counter()
    position = -1
    for event in ordered:
        if event.name in MATMULS:
            position += 1
        elif event.name not in FOLLOWERS or position < 0:
            continue
        us[roles[position % len(roles)]] += event.time_range.elapsed_us()
    if position + 1 != steps * len(roles):
        return {}
    return {"matmuls": {role: us[role] / steps for role in (*ROLES, "head")}}

"""The q1 section: the op set's Q1 linear (exact integer arithmetic, ``q1_exact``) on random
``Q1Weight``s against B1 (copy GB/s) and B2 (fp16 ``torch.matmul`` on the dequantized weight), timed over
enough weight copies to stay out of L2, with the float kernels' time beside it. Checks: the exact
linear equals the CPU engine's ``Q1Matrix.matmul`` bit for bit, and on CUDA each PTX kernel equals
its twin."""

from __future__ import annotations

import datetime
import gc
import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton

import oxibonsai
from oxibonsai.torch_backend.ops import ref_torch
from oxibonsai.torch_backend.ops.q1_weight import QK, Q1Weight, unpack

from .plan import SEED, ModelSpec, Plan
from .timing import Budget, environment, gbps, guarded, ratio, time_calls


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


def q1_shapes(spec: ModelSpec, roles: Sequence[str]) -> list[tuple[str, int, int, bool]]:
    """``(name, rows, cols, gated)`` of each role's matrix: the model's own (its fused QKV, its gate|up
    with the SwiGLU epilogue, O, down, the LM head) or single projections (q, kv, gate)."""
    c = spec.config
    shapes = {"qkv": (c.q_dim + 2 * c.kv_dim, c.hidden, False), "o": (c.hidden, c.q_dim, False),
              "gate_up": (2 * c.ffn, c.hidden, True), "down": (c.hidden, c.ffn, False),
              "head": (c.vocab, c.hidden, False), "q": (c.q_dim, c.hidden, False),
              "kv": (c.kv_dim, c.hidden, False), "gate": (c.ffn, c.hidden, False)}  # fmt: skip
    return [(f"{spec.name}.{role}", *shapes[role]) for role in roles]


def q1_section(plan: Plan, device: torch.device, budget: Budget, b1: float | None) -> dict[str, Any]:
    from oxibonsai.torch_backend.ops import q1_exact

    linear = q1_exact.fused_linear

    rows: list[dict[str, Any]] = []
    for spec in plan.models:
        for name, n, k, gated in q1_shapes(spec, plan.q1_roles):
            if budget.over():
                rows.append({"shape": name, **budget.skipped()})
                continue
            rows += q1_shape(partial(linear, gated=gated), name, n, k, gated, plan, device, b1)
            gc.collect()
    return {"b1_d2d_gbps": b1, "kernel": f"{linear.__module__}.{linear.__name__}",
            "float_kernel": f"{float_linear(device).__module__}.{float_linear(device).__name__}",
            "rows": rows}  # fmt: skip


def float_linear(device: torch.device) -> Callable[..., torch.Tensor]:
    """The float op set's linear: the f16x2 GEMV up to 2 rows once checked on CUDA, the plain Triton
    kernels otherwise (the smoke run interprets them)."""
    from oxibonsai.torch_backend.ops import q1_fast, q1_triton

    return q1_fast.fused_linear if device.type == "cuda" else q1_triton.q1_fused_linear


def cpu_matrix(w: Q1Weight) -> oxibonsai.Q1Matrix:
    """The same matrix for the CPU engine: GGUF's 18-byte blocks (fp16 scale, 16 bytes of signs)."""
    scales = w.scales.cpu().numpy().view(np.uint8).reshape(w.rows, -1, 2)
    signs = w.signs.cpu().numpy().view(np.uint8).reshape(w.rows, -1, 16)
    return oxibonsai.Q1Matrix.from_bytes(np.concatenate([scales, signs], axis=2).tobytes(), w.rows, w.cols)


def copies(nbytes: int, plan: Plan) -> int:
    return max(1, min(plan.max_copies, -(-plan.rotate_bytes // nbytes)))


def q1_shape(
    kernel: Callable[..., torch.Tensor], name: str, n: int, k: int, gated: bool, plan: Plan,
    device: torch.device, b1: float | None,
) -> list[dict[str, Any]]:  # fmt: skip
    q1_bytes, fp16_bytes = n * k * 18 // 128, n * k * 2
    torch.manual_seed(SEED)
    ours = [random_q1(n, k, 0.02, device) for _ in range(copies(q1_bytes, plan))]
    dense = [dequantize_half(w) for w in ours[: copies(fp16_bytes, plan)]]
    out = []
    for m in plan.q1_m:
        label = {"shape": name, "rows": n, "cols": k, "gated": gated, "m": m, "weight_bytes": q1_bytes}
        out.append(guarded(partial(q1_case, kernel, ours, dense, m, gated, plan, device, b1), **label))
    return out


def q1_case(
    kernel: Callable[..., torch.Tensor], ours: list[Q1Weight], dense: list[torch.Tensor], m: int,
    gated: bool, plan: Plan, device: torch.device, b1: float | None,
) -> dict[str, Any]:  # fmt: skip
    """One shape at ``m`` rows (``kernel`` and the float op with the SwiGLU epilogue when ``gated``;
    B2 is the plain matmul either way, and the CPU engine check is of the plain exact matmul)."""
    from oxibonsai.torch_backend.ops import q1_exact

    w0 = ours[0]
    x = torch.randn(m, w0.cols, device=device)
    x16 = x.to(torch.float16)
    got, want = kernel(x, w0), ref_torch.q1_fused_linear(x, w0, gated=gated)
    mine = time_calls([partial(kernel, x, w) for w in ours], device, plan.reps)
    float_op = partial(float_linear(device), gated=gated)
    floats = time_calls([partial(float_op, x, w) for w in ours], device, plan.reps)
    base = time_calls([partial(torch.matmul, x16, w.T) for w in dense], device, plan.reps)
    ours_gbps = gbps(w0.rows * w0.cols * 18 / 128, mine["ms"])
    plain = q1_exact.fused_linear(x, w0) if gated else got
    cpu = cpu_matrix(w0).matmul(x.cpu().numpy()).reshape(m, w0.rows)
    return {**exact_check(x, w0, device, gated), **fast_check(x, ours, plan, device, floats["ms"], gated),
        **exact_sweep(x, ours, plan, device, gated),
        "equals_cpu_engine": bool(np.array_equal(plain.cpu().numpy(), cpu)),
        "float_ms": floats["ms"], "float_over_ours": ratio(floats["ms"], mine["ms"]),
        "ours_ms": mine["ms"], "ours_eager_ms": mine["eager_ms"], "timing": mine["timing"],
        "weight_copies": len(ours), "ours_gbps": ours_gbps, "ours_over_b1": ratio(ours_gbps, b1),
        "b2_ms": base["ms"], "b2_gbps": gbps(w0.rows * w0.cols * 2, base["ms"]),
        "speedup_vs_b2": ratio(base["ms"], mine["ms"]),
        "rel_err": float((got - want).norm() / want.norm()), "finite": bool(torch.isfinite(got).all()),
    }  # fmt: skip


def exact_check(x: torch.Tensor, w: Q1Weight, device: torch.device, gated: bool) -> dict[str, Any]:
    """Up to ``q1_exact.GEMV_MAX_M`` rows on CUDA: whether the dp4a PTX GEMV equals its twin bit for bit
    and whether the op set used it."""
    from oxibonsai.torch_backend.ops import q1_exact

    if device.type != "cuda" or x.shape[0] > q1_exact.GEMV_MAX_M:
        return {}
    acts = q1_exact.quantize(x)
    ptx, twin = (q1_exact.linear_quantized(acts, w, asm=asm, gated=gated) for asm in (True, False))
    same = torch.equal(ptx, twin)
    return {"dp4a_used": q1_exact._asm_ok(device), "dp4a_asm_equals_twin": same}


def exact_sweep(
    x: torch.Tensor, ours: list[Q1Weight], plan: Plan, device: torch.device, gated: bool
) -> dict[str, Any]:
    """At one or four activation rows, the quantization's time, then the exact matmul's (already
    quantized) in each GEMV form and split (K split inside programs, "gemv_split", or over them,
    "gemv", and combined in the same launch, "gemv_fixup"); at 16 and 64 rows the GEMM at each tile
    width (its default K split over programs), then unsplit, with the other dot depth and on weights
    expanded to bytes (at the default width); at 512 rows the last of those: for tuning ``q1_exact``'s
    defaults on the GPU. ``sweep_ms["default"]`` is the op's own choice without a tuned table, which
    ``sweep_default`` names (with the GEMM's width and split); ``sweep_options`` gives each form's
    options, for a table of the forms that beat it (``q1_tuned.choices_from_sweep``)."""
    from oxibonsai.torch_backend.ops import q1_exact, q1_tuned

    m, w0 = x.shape[0], ours[0]
    out_rows = w0.rows // 2 if gated else w0.rows
    forms = sweep_forms(m, out_rows, w0.cols // 128, gated)
    if not forms:
        return {}
    acts = q1_exact.quantize(x)
    times = {"quantize": time_calls([partial(q1_exact.quantize, x)], device, plan.reps)["ms"]}
    with environment(q1_tuned.ENV_VAR, "0"):  # the built-in defaults, whatever table ships
        defaults = [partial(q1_exact.linear_quantized, acts, w, gated=gated) for w in ours]
        times["default"] = time_calls(defaults, device, plan.reps)["ms"]
    for label, options in forms:
        calls = [partial(q1_exact.linear_quantized, acts, w, gated=gated, **options) for w in ours]
        times[label] = time_calls(calls, device, plan.reps)["ms"]
        if options.get("kernel") == "gemm_expanded":  # its expansion alone: what keeping the bytes saves
            expand = [partial(q1_exact.expand_bits, w) for w in ours]
            times["expand"] = time_calls(expand, device, plan.reps)["ms"]
    default = q1_exact._default_kernel(m, out_rows, w0.cols // 128, device)
    if default == "gemm":
        default += "/n{}/s{}".format(*q1_exact.gemm_tiling(m, w0, gated, device))
    return {"sweep_ms": times, "sweep_default": default, "sweep_options": dict(forms)}


def write_tuned_table(q1: dict[str, Any], path: Path, device: torch.device) -> Path | None:
    """The q1 section's sweep as a ``q1_tuned`` table at ``path`` (returned), None where no form beat
    the defaults (nothing written)."""
    from oxibonsai.torch_backend.ops import q1_tuned

    choices = q1_tuned.choices_from_sweep(q1.get("rows", []))
    if not choices:
        return None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    table = {"device": name, "triton": triton.__version__, "torch": torch.__version__,
             "measured": datetime.date.today().isoformat(), "choices": choices}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


SWEEP_ROWS = (1, 4)  # the activation rows at which ``exact_sweep`` runs the GEMV forms
GEMM_SWEEP_ROWS = (16, 64)  # and the GEMM's tile widths
GEMM_SWEEP_MAX_ROWS = 16384  # weight rows: wider matrices (the LM head) fill the GPU at any width
PREFILL_SWEEP_ROWS = (512,)  # and the GEMM on expanded weights alone


def sweep_forms(m: int, rows: int, groups: int, gated: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """``exact_sweep``'s forms at ``m`` activation rows of a matrix of ``rows`` output rows (a gate|up
    matrix's half, ``gated``) and 128-weight ``groups``: a label and ``q1_exact.linear_quantized``'s
    keyword arguments (but ``gated``) for each."""
    from oxibonsai.torch_backend.ops import q1_exact

    expanded = ("gemm_expanded", {"kernel": "gemm_expanded"})  # the weights as bytes, at the default tile
    if m in GEMM_SWEEP_ROWS and rows <= GEMM_SWEEP_MAX_ROWS:
        widths = [(f"gemm/n{n}", {"kernel": "gemm", "block_n": n}) for n in q1_exact.gemm_block_ns(gated)]
        unsplit = {"kernel": "gemm", "split_k": 1}  # each at the default width
        group_dots = {"kernel": "gemm", "group_dot": not q1_exact.GEMM_GROUP_DOT}
        return [
            *widths,
            ("gemm/s1", unsplit),
            (f"gemm/group_dot={group_dots['group_dot']}", group_dots),
            expanded,
        ]
    if m in PREFILL_SWEEP_ROWS and rows <= GEMM_SWEEP_MAX_ROWS:
        return [expanded]
    if m not in SWEEP_ROWS:
        return []
    inside = (2, 4, 8, 16) if m == 1 else (4, 16)
    over = (1, 4, None) if m == 1 else (None,)
    fixed = (4, None) if m == 1 else (None,)  # over programs, combined in the same launch
    gemvs = [("gemv_split", s) for s in inside if s <= groups] + [("gemv", s) for s in over]
    gemvs += [("gemv_fixup", s) for s in fixed]
    forms = [(f"{kernel}/{split or 'auto'}", {"kernel": kernel, "split_k": split}) for kernel, split in gemvs]
    narrow = q1_exact.gemv_block_ns(m, gated)[0]  # one weight row a thread where the default takes two
    if narrow != q1_exact.gemv_rows(int(triton.next_power_of_2(m)), gated):
        forms.append((f"gemv/1/n{narrow}", {"kernel": "gemv", "split_k": 1, "block_n": narrow}))
    return forms


def fast_check(
    x: torch.Tensor, ours: list[Q1Weight], plan: Plan, device: torch.device, ms: float, gated: bool
) -> dict[str, Any]:
    """Up to ``q1_fast.MAX_M`` rows on CUDA: whether the f16x2 PTX equals its twin bit for bit, and the
    plain Triton GEMV's time beside the float op's (``ms``)."""
    from oxibonsai.torch_backend.ops import q1_fast, q1_triton

    if device.type != "cuda" or x.shape[0] > q1_fast.MAX_M:
        return {}
    w0 = ours[0]
    fast = partial(q1_fast.q1_gemv_fast, x, w0, gated=gated)
    same = torch.equal(fast(asm=True), fast(asm=False))
    plain_op = partial(q1_triton.q1_gemv_fused, gated=gated)
    plain = time_calls([partial(plain_op, x, w) for w in ours], device, plan.reps)
    return {"fast_used": q1_fast._asm_ok(device), "fast_asm_equals_twin": same, "plain_ms": plain["ms"],
            "plain_over_float": ratio(plain["ms"], ms)}  # fmt: skip

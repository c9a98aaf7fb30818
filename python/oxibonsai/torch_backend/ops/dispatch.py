"""Which op set a device runs: the one place that chooses between Triton kernels and plain torch.

``ops_for(device)`` returns a namespace with ``OP_NAMES`` (the exact Triton set ``ops.ahead.OPS`` too).
CUDA gets the Triton kernels (with the reference op wherever no Triton twin exists) when Triton is
installed; MPS gets ``ref_torch`` with the int4-pack Q1 linear (``q1_int4pack``: Triton does not run
on Metal); every other device gets ``ref_torch``. ``OXIBONSAI_TORCH_OPS=ref|triton|int4pack`` forces
a set. Triton off CUDA means Triton's CPU interpreter (tests only), which must have been enabled
(``TRITON_INTERPRET=1``) before the kernel modules were imported; anything else raises here rather
than at the first launch.

``attention_linear`` is the attention followed by its output projection: each set composes its own
``paged_attention`` and ``q1_fused_linear``, except the exact Triton set, which quantizes the
projection's activations inside the attention (``attn_triton.attention_linear``). The exact Triton
set also has ``ops.ahead.OPS``: its matmuls quantize their outputs for the next matmul; and
``rope_kv``: its attention takes a layer's QKV rows as ``attn_triton.RopeKv`` instead of q, and in a
decode step does their QK-norm, RoPE and K/V write itself.

The Triton set's Q1 matmuls run the CPU engine's exact integer arithmetic (``q1_exact``: the same bits
at every batch size) unless ``OXIBONSAI_Q1_ARITHMETIC=float`` picks the float kernels (``q1_triton``
and ``q1_fast``'s f16x2 GEMV: float32 sums, tf32 GEMM; a row's bits depend on the batch size)."""

from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace

import torch

from oxibonsai.torch_backend.ops import q1_int4pack, ref_torch

OP_NAMES = (
    "q1_linear",
    "q1_fused_linear",
    "embedding",
    "rms_norm",
    "rope_neox",
    "silu_mul",
    "write_kv",
    "qk_norm_rope_write_kv",
    "paged_attention",
    "attention_linear",
)
ENV_VAR = "OXIBONSAI_TORCH_OPS"
CHOICES = ("ref", "triton", "int4pack")
Q1_ENV_VAR = "OXIBONSAI_Q1_ARITHMETIC"
Q1_ARITHMETICS = ("exact", "float")


def ops_for(device: torch.device | str) -> SimpleNamespace:
    """The op set for ``device`` (see the module doc)."""
    device = torch.device(device)
    choice = _choice(device)
    if choice == "triton":
        return _triton_ops(device)
    if choice == "int4pack":
        return q1_int4pack.ops_int4pack()
    return SimpleNamespace(**{name: getattr(ref_torch, name) for name in OP_NAMES})


def _choice(device: torch.device) -> str:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced and forced not in CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {CHOICES}, got {forced!r}")
    if forced:
        return forced
    if device.type == "cuda" and _triton_installed():
        return "triton"
    return "int4pack" if device.type == "mps" else "ref"


def _triton_ops(device: torch.device) -> SimpleNamespace:
    if not _triton_installed():
        raise RuntimeError(f"{ENV_VAR}=triton needs the triton package, which is not installed")
    if device.type != "cuda" and not _kernels_interpreted():
        raise RuntimeError(
            f"Triton kernels run on CUDA, or on {device.type} under Triton's interpreter only: set "
            "TRITON_INTERPRET=1 before oxibonsai.torch_backend.ops' Triton modules are imported"
        )
    return triton_op_set(q1_arithmetic())


def q1_arithmetic() -> str:
    """The Triton set's Q1 arithmetic: ``OXIBONSAI_Q1_ARITHMETIC``, "exact" by default."""
    chosen = os.environ.get(Q1_ENV_VAR, "").strip().lower() or "exact"
    if chosen not in Q1_ARITHMETICS:
        raise ValueError(f"{Q1_ENV_VAR} must be one of {Q1_ARITHMETICS}, got {chosen!r}")
    return chosen


def triton_op_set(q1: str = "exact") -> SimpleNamespace:
    """The Triton kernels as an op set, with ``q1`` (one of ``Q1_ARITHMETICS``) Q1 matmuls; no device
    check (``benches/gpu/sass.py`` records its launches on the meta device)."""
    from oxibonsai.torch_backend.ops import (
        attn_triton,
        embed_triton,
        kv_triton,
        norm_triton,
        q1_exact,
        q1_fast,
        q1_triton,
        rope_kv_triton,
    )

    exact = q1 == "exact"
    fused_linear = q1_exact.fused_linear if exact else q1_fast.fused_linear
    ahead = {
        "q1_fused_linear_ahead": q1_exact.fused_linear_ahead,
        "attention_linear_ahead": attn_triton.attention_linear_ahead,
        "rope_kv": attn_triton.RopeKv,  # its attention takes the QKV rows (a decode step: one launch)
    }
    return SimpleNamespace(
        **(ahead if exact else {}),
        q1_linear=q1_exact.q1_linear if exact else q1_triton.q1_linear,
        q1_fused_linear=fused_linear,
        embedding=embed_triton.embedding,
        rms_norm=norm_triton.rms_norm,
        rope_neox=ref_torch.rope_neox,
        silu_mul=ref_torch.silu_mul,
        write_kv=kv_triton.write_kv,
        qk_norm_rope_write_kv=rope_kv_triton.qk_norm_rope_write_kv,
        paged_attention=attn_triton.paged_attention,
        attention_linear=(
            attn_triton.attention_linear
            if exact
            else functools.partial(
                ref_torch.composed_attention_linear, attn_triton.paged_attention, fused_linear
            )
        ),
    )


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernels_interpreted() -> bool:
    """Whether the kernels were decorated in interpreter mode (fixed when ``@triton.jit`` ran)."""
    from oxibonsai.torch_backend.ops import q1_triton

    return type(q1_triton._gemv_kernel).__name__ == "InterpretedFunction"

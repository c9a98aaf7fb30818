"""Programmatic dependent launch (PDL, NVIDIA Hopper and later) for the decode step's kernels.

A decode step is a chain of a few hundred small kernels, and on a GPU the gap between two of them (the
next grid's launch and ramp-up after the previous one drains) is a large part of the step. A kernel
launched with PDL may be scheduled while the kernel before it in the stream is still running: its
programs start, wait in ``griddepcontrol.wait`` until that kernel has completed and its writes are
visible, then run. Each kernel here also signals at once (``griddepcontrol.launch_dependents``) that
the next one may be scheduled, which the hardware does only once all of this kernel's programs have
started, so a waiting program never takes an SM slot from one of the kernel it waits on.

Correctness rests on one rule this module keeps: a launch gets the PDL attribute (``launch_pdl``) only
together with ``PDL=True``, with which the kernel reaches ``grid_dependency`` before any memory
access; before it a kernel only computes indices and may ask L2 for its weights (``prefetch_l2``, a
hint that reads nothing), so the GEMVs' weights stream in while the kernel before them still runs. A
kernel launched without the attribute (torch's, the float op set's) is ordered as usual, and a PDL
kernel after it still waits for it. Under CUDA graphs the attribute becomes a programmatic edge.

On by default on CUDA devices of compute capability 9.0 and later, for steps of at most 8 token rows
(``pdl_rows``: measured, it slowed the GEMM steps); ``OXIBONSAI_PDL=0`` turns it off, ``=all`` on for
every step (for comparisons: ``benches/bench_gpu.py`` times decode both ways)."""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from oxibonsai.torch_backend.ops import pdl_rows

ENV_VAR = pdl_rows.ENV_VAR
_verdicts: dict[int, bool] = {}  # per CUDA device index: whether PDL is used there


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the kernel before it, then let the next one be
    scheduled. Nothing without ``PDL`` (the interpreter, other devices, PDL off)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, PDL: tl.constexpr):
    """With ``PDL``, asks L2 for the lines at ``ptrs`` (any shape): a hint that reads no value, so a
    kernel may issue it before its grid-dependency wait, for data the kernel before it cannot be
    writing (weights), whose loads after the wait then find it in L2."""
    if PDL:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )


def enabled(device: torch.device) -> bool:
    """Whether kernels launched for tensors on ``device`` use PDL: once ``chain_works`` has held there
    (checked at the first launch outside a CUDA graph capture; launches before it go without)."""
    if device.type != "cuda" or os.environ.get(ENV_VAR, "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    verdict = _verdicts.get(index)
    if verdict is None:
        if torch.cuda.is_current_stream_capturing():  # the check synchronizes: not inside a capture
            return False
        major, _ = torch.cuda.get_device_capability(index)
        verdict = major >= 9 and triton_has_pdl() and chain_works(torch.device("cuda", index))
        _verdicts[index] = verdict
    return verdict


def launch(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel with a ``PDL`` parameter: ``PDL`` and, when on (and the step's
    rows allow it: ``pdl_rows``), the launch attribute (never one without the other)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) and pdl_rows.allowed() else {"PDL": False}


def chain_works(device: torch.device) -> bool:
    """Whether two PDL kernels, the second reading what the first wrote, give the right values on
    ``device`` eagerly and replayed from a CUDA graph. On a wrong value or an error (a driver or a torch
    that cannot launch or capture them) it warns, and kernels launch without PDL."""
    try:
        x = torch.arange(PROBE_SIZE, dtype=torch.float32, device=device)
        y, z = torch.zeros_like(x), torch.zeros_like(x)  # a read that came too early would see zeros

        def chain() -> None:
            for src, dst in ((x, y), (y, z)):
                _double_kernel[(PROBE_SIZE // 128,)](src, dst, PDL=True, launch_pdl=True)

        chain()
        eager = torch.equal(z, 4 * x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        y.zero_()
        z.zero_()
        graph.replay()
        replayed = torch.equal(z, 4 * x)
    except Exception as e:  # never fatal: the kernels run without PDL
        warnings.warn(f"programmatic dependent launch failed here ({type(e).__name__}: {e}); it stays off",
                      stacklevel=2)  # fmt: skip
        return False
    if not (eager and replayed):
        warnings.warn("programmatic dependent launch gave wrong values here; it stays off", stacklevel=2)
    return eager and replayed


PROBE_SIZE = 1 << 16


@triton.jit
def _double_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    grid_dependency(PDL)
    offs = tl.program_id(0) * 128 + tl.arange(0, 128)
    tl.store(dst_ptr + offs, 2 * tl.load(src_ptr + offs))


def triton_has_pdl() -> bool:
    """Whether this Triton launches with the PDL attribute (3.3 and later)."""
    from triton.backends.nvidia.compiler import CUDAOptions

    return any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))

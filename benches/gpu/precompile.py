"""Compiles the Triton kernels the GPU run will launch before it starts, on all the machine's cores,
into Triton's on-disk cache, so that ``bench_gpu.py`` and the tests load them instead of compiling
them one at a time inside the device minutes.

The launches are recorded as ``sass.py`` records them, on the ``meta`` device with Triton's own binder
(the signature, constants and alignment hints the JIT derives at run time), for the GPU plan's models
in decode at every CUDA-graph bucket up to its largest batch and in its prefill, both Q1 arithmetics,
a step of a row count no multiple of 16 (the engine's prefill chunks), the exact kernels without PDL
at the decode section's batches (its graphs without PDL and its kernel profile), its one-row graphs
unfused (the quantizations and the QK-norm/RoPE/KV write in launches of their own) and with each
form of the split GEMV, its larger batches' graphs with the decode kernel merging, and the q1
section's matmuls, sweep, float op, twins and plain GEMV; each is then compiled exactly as the JIT
would compile it (the same cache entry). A launch whose arguments differ at run time (another
alignment, an int that is 1 here and not there) is compiled then, as before: this only ever saves
time. It needs no GPU, so it runs here too (``--arch`` 90: the H100 and H200), and with ``--libtriton``
(the device Triton's native library: the same version built for the device's Python) it writes the
entries the device will look for, which ``scripts/device_bundle.sh`` carries there
(``gpu.triton_cache``).

    python benches/gpu/precompile.py [--arch 90] [--jobs N] [--libtriton PATH]"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benches/, for the gpu package

from gpu.plan import GPU_PLAN, Plan
from gpu.q1 import q1_shapes, random_q1, sweep_forms
from gpu.sass import H100_SMS, Launch, as_on_a_gpu, compile_exactly, model_launches, recording
from gpu.timing import environment
from gpu.triton_cache import default_cache_dir, device_keys, entry_name
from oxibonsai.torch_backend.graphs import decode_buckets
from oxibonsai.torch_backend.ops import attn_triton, q1_exact
from oxibonsai.torch_backend.ops.dispatch import Q1_ARITHMETICS

_LAUNCHES: list[Launch] = []  # what the forked workers compile, by index
ODD_ROWS = 37  # prefill rows of the extra step: not a multiple of 16, above the GEMV's 8


def planned_launches(plan: Plan) -> list[Launch]:
    """Every distinct launch of the plan's decode, prefill and q1 sections (see the module doc)."""
    launches: dict[tuple[Any, ...], Launch] = {}
    batches = decode_buckets(max(plan.batches))
    for spec in plan.models:
        for q1 in Q1_ARITHMETICS:
            launches.update(model_launches(spec, batches, plan.prefill_tokens, q1))
            # a step of a row count no multiple of 16 (the JIT specializes ints on it): the engine's
            # prefill chunks and mixed steps
            launches.update(model_launches(spec, (1,), ODD_ROWS, q1))
        # the decode section's graphs without PDL and its kernel profile (PDL off) at its batches
        launches.update(model_launches(spec, tuple(plan.batches), plan.prefill_tokens, pdl_on=False))
        with environment(q1_exact.FUSE_ENV_VAR, "0"), environment(attn_triton.FUSE_ROPE_ENV_VAR, "0"):
            launches.update(model_launches(spec, (1,), plan.prefill_tokens))  # its one-row graphs unfused
        with environment(attn_triton.FUSE_MERGE_ENV_VAR, "all"):  # and above 8 rows merging in the kernel
            wide = tuple(b for b in plan.batches if b > attn_triton.MERGE_MAX_ROWS)
            launches.update(model_launches(spec, wide, plan.prefill_tokens))
        for kernel in q1_exact.ONE_ROW_KERNELS:  # and with each form of the one-row split GEMV
            with environment(q1_exact.ONE_ROW_ENV_VAR, kernel):
                launches.update(model_launches(spec, (1,), plan.prefill_tokens))
        launches.update(q1_launches(spec, plan))
    return list(launches.values())


def q1_launches(spec: Any, plan: Plan) -> dict[tuple[Any, ...], Launch]:
    """The q1 section's matmuls at each M: the exact op, its sweep's forms (``gpu.q1.sweep_forms``), the
    float op, and where they run, the PTX kernels' twins and the plain Triton GEMV."""
    from oxibonsai.torch_backend.ops import q1_exact, q1_fast, q1_triton

    meta = torch.device("meta")
    with recording() as launches, as_on_a_gpu(H100_SMS):
        for _, rows, cols, gated in q1_shapes(spec, plan.q1_roles):
            w = random_q1(rows, cols, 0.02, meta)
            for m in plan.q1_m:
                x = torch.empty(m, cols, device=meta)
                q1_exact.fused_linear(x, w, gated=gated)
                q1_exact.fused_linear(x, w)  # its CPU engine check
                q1_fast.fused_linear(x, w, gated=gated)
                acts = q1_exact.quantize(x)
                for _, options in sweep_forms(m, rows // 2 if gated else rows, cols // 128, gated):
                    q1_exact.linear_quantized(acts, w, gated=gated, **options)
                if m <= q1_exact.GEMV_MAX_M:
                    q1_exact.linear_quantized(acts, w, asm=False, gated=gated)
                if m <= q1_fast.MAX_M:
                    for asm in (True, False):
                        q1_fast.q1_gemv_fast(x, w, asm=asm, gated=gated)
                    q1_triton.q1_gemv_fused(x, w, gated=gated)
    return launches


def _compile(index: int) -> tuple[str | None, str | None]:
    """The launch's cache entry, or its error."""
    try:
        kernel = compile_exactly(_LAUNCHES[index], ARGS.arch)
    except Exception as e:  # reported; the run compiles it itself if it ever launches it
        return None, f"{_LAUNCHES[index].fn.__name__}: {type(e).__name__}: {e}"
    if ARGS.launchers:
        try:  # Triton's C launcher for the kernel's signature, built with gcc and cached on first use
            from triton.backends.nvidia.driver import CudaLauncher

            CudaLauncher(kernel.src, kernel.metadata)
        except Exception as e:
            return entry_name(kernel.hash), f"{kernel.name} launcher: {type(e).__name__}: {str(e)[:200]}"
    return entry_name(kernel.hash), None


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--libtriton", type=Path, help="key the entries for the Triton with this libtriton.so")
    p.add_argument("--manifest", type=Path, help="write the launches' cache entries there, a line each")
    p.add_argument("--launchers", action="store_true",
                   help="build each kernel's C launcher too (needs libcuda: the GPU machine)")  # fmt: skip
    ARGS = p.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter cannot compile kernels")
    if ARGS.libtriton:
        device_keys(ARGS.libtriton)  # before the workers fork
    start = time.perf_counter()
    cache_dir = default_cache_dir()
    cached = {p.name for p in cache_dir.iterdir()} if cache_dir.is_dir() else set()
    _LAUNCHES.extend(planned_launches(GPU_PLAN))
    recorded = time.perf_counter() - start
    with multiprocessing.get_context("fork").Pool(ARGS.jobs) as pool:
        results = pool.map(_compile, range(len(_LAUNCHES)))
    errors = [e for _, e in results if e is not None]
    for error in errors[:20]:
        print(error)
    names = {n for n, _ in results if n}
    if ARGS.manifest:
        ARGS.manifest.write_text("".join(f"{name}\n" for name in sorted(names)))
    done = sum(1 for n, _ in results if n)
    found = sum(1 for n, _ in results if n in cached)  # carried, or from an earlier run
    print(f"{found} of {done} launches were in the cache already ({len(names)} kernels), the rest compiled")
    print(f"precompiled {done} of {len(_LAUNCHES)} launches for sm_{ARGS.arch} with {ARGS.jobs} jobs "
          f"in {time.perf_counter() - start:.1f} s ({recorded:.1f} s recording)")  # fmt: skip


ARGS = argparse.Namespace(arch=90)

if __name__ == "__main__":
    main()

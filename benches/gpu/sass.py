"""Every Triton kernel the torch model launches, compiled for an NVIDIA GPU without one, with its SASS
counted: what a CPU-only machine can learn about the GPU kernels.

The model's forward pass runs on the ``meta`` device (shapes, no data) with the Triton op set and
``JITFunction.run`` replaced by a recorder, so every launch a decode step and a prefill make is
collected with its argument types and constexprs, nothing executed. Each distinct launch is then
compiled ahead of time for ``--arch`` (default 90, the H100/H200) through Triton's own compiler and
ptxas, which ship with Triton and need no driver, and its SASS disassembled with the bundled
``cuobjdump``. Per kernel it reports registers, spill instructions, the longest loop's instruction
count and, for the Q1 GEMV, SASS instructions per weight and activation row (a static measure of its
ALU cost: the loop body's instructions per thread, times the threads, over the weight-row products
the loop covers).

    python benches/gpu/sass.py --model 1.7b            # the table
    python benches/gpu/sass.py --model tiny --check    # exit 1: a compile error, a spill, a PDL race
    SASS_TOP_OPS=40 python benches/gpu/sass.py ...     # more of each kernel's loop opcodes (default 5)
    SASS_LOOP_LOADS=1 python benches/gpu/sass.py ...   # and where in the loop its global loads sit
    python benches/gpu/sass.py --gemm-forms 64 512     # the GEMM's forms on the Q matrix, unsplit

It must run without ``TRITON_INTERPRET`` (the interpreter has no compiler); the test suite runs the
``--check`` form in a subprocess."""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benches/, for the gpu package

from gpu.models import random_weights
from gpu.plan import BONSAI_1P7B, BONSAI_8B, TINY_UNTIED, ModelSpec
from oxibonsai.torch_backend.batch import StepBatch
from oxibonsai.torch_backend.kv_pool import KvPool
from oxibonsai.torch_backend.model import TorchQwen3
from oxibonsai.torch_backend.ops.dispatch import Q1_ARITHMETICS, triton_op_set

MODELS = {"tiny": TINY_UNTIED, "1.7b": BONSAI_1P7B, "8b": BONSAI_8B}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
H100_SMS = 132


@dataclass
class Launch:
    """One distinct launch as Triton's JIT would compile it for an NVIDIA GPU of ``ARCH``: the kernel, the
    signature, constexprs, attributes and options its binder derives from the arguments (an int equal to
    1 becomes a constexpr, a pointer or int divisible by 16 gets that hint), what ``triton.compile``
    takes."""

    fn: JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]  # by name, for reading: the kernel's constexpr parameters
    source_constexprs: dict[tuple[int, ...], Any]  # by argument path, as the JIT passes them
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]  # every compile option (the launch's and the backend's defaults)
    count: int = 1
    key: tuple[Any, ...] = field(default=())


ARCH = 90  # the lent GPUs (H100, H200): sm_90


class _Pointer:
    """What the JIT's specialization reads of a tensor argument: its dtype and whether its address is
    16-byte aligned (a fresh allocation is; a view may not be), from a tensor on ``meta``."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self._address = t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return self._address


def runtime_view(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any], arch: int = ARCH) -> Launch:
    """The launch ``fn[grid](*args, **kwargs)`` as the JIT's own binder sees it on sm_``arch``."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**kwargs, "debug": kwargs.get("debug", fn.debug) or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}  # fmt: skip
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # Triton 3.9 (not 3.6) passes it too
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    args = tuple(_Pointer(a) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: _Pointer(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    named = {p.name: bound[p.name] for p in fn.params if p.is_constexpr}
    return Launch(fn, signature, named, constexprs, attrs, dict(options.__dict__))


@contextmanager
def recording() -> Iterator[dict[tuple[Any, ...], Launch]]:
    """Replaces every kernel launch by a record of what the JIT would compile for it (nothing runs)."""
    launches: dict[tuple[Any, ...], Launch] = {}
    original = JITFunction.run

    def record(self: JITFunction, *args: Any, grid: Any = None, warmup: bool = False, **kwargs: Any) -> None:
        launch = runtime_view(self, args, kwargs)
        parts = (launch.signature, launch.source_constexprs, launch.attrs, launch.options)
        key = (self.__name__, *(repr(sorted(d.items())) for d in parts))
        if key in launches:
            launches[key].count += 1
        else:
            launch.key = key
            launches[key] = launch

    JITFunction.run = record  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.run = original  # type: ignore[method-assign]


@contextmanager
def as_on_a_gpu(multiprocessors: int, pdl_on: bool = True) -> Iterator[None]:
    """The wrappers' device-dependent choices (attention precision and splits, the GEMV's split-K, the
    GEMM's tile width, programmatic dependent launch unless not ``pdl_on``) made as on a CUDA device
    with ``multiprocessors`` SMs (sm_90), for tensors on ``meta``."""
    from oxibonsai.torch_backend.ops import attn_triton, pdl, q1_exact, q1_fast, q1_triton

    def split_k(per_sm: int, tiles: int, groups: int) -> int:
        return max(1, min(groups, per_sm * multiprocessors // max(tiles, 1)))

    patches = [
        (attn_triton, "_on_gpu", lambda device: True),
        (pdl, "enabled", lambda device: pdl_on and pdl.triton_has_pdl()),
        (q1_fast, "_asm_ok", lambda device: True),
        (q1_exact, "_asm_ok", lambda device: True),
        (q1_exact, "_fences", lambda device: True),
        (q1_triton, "_default_split_k", lambda tiles, groups, device: split_k(2, tiles, groups)),
        (q1_exact, "_gemm_sms", lambda device: multiprocessors),
        (
            q1_exact,
            "_default_split_k",
            lambda tiles, groups, device: split_k(q1_exact.PROGRAMS_PER_SM, tiles, groups),
        ),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def model_launches(
    spec: ModelSpec, batches: tuple[int, ...], prefill: int, q1: str = "exact", pdl_on: bool = True
) -> dict[tuple[Any, ...], Launch]:
    """The launches of decode steps at ``batches`` and a ``prefill``-token prefill, on ``meta``, as on an
    H100 (132 SMs), with ``q1`` Q1 arithmetic (``dispatch.Q1_ARITHMETICS``), with PDL if ``pdl_on``."""
    meta = torch.device("meta")
    model = TorchQwen3(spec.config, random_weights(spec, meta), triton_op_set(q1))
    c = spec.config
    per_seq = -(-(prefill + 1) // 16)
    pool = KvPool(c.n_layers, max(batches) * per_seq, c.n_kv_heads, c.head_dim, torch.float16, meta)
    steps = [StepBatch.for_sequences([(list(range(per_seq)), 0, [1] * prefill, "last")])]
    context = max(prefill - 1, 1)  # a lone token after a context: a decode row (the decode kernel)
    for b in batches:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        steps.append(StepBatch.for_sequences([(t, context, [1], "last") for t in tables]))
    with recording() as launches, as_on_a_gpu(H100_SMS, pdl_on):
        for step in steps:
            model.forward(step.to_device(meta), pool)
    return launches


GEMM_FORMS = (("gemm", {}), ("gemm", {"group_dot": True}), ("gemm_expanded", {}))


def gemm_form_launches(spec: ModelSpec, rows: tuple[int, ...]) -> dict[tuple[Any, ...], Launch]:
    """The exact GEMM's launches in each of ``GEMM_FORMS`` (unsplit: one sign word a dot, a group a
    dot, weights expanded to bytes) on the model's square Q matrix at each of ``rows``, as on an H100."""
    from oxibonsai.torch_backend.ops import q1_exact
    from oxibonsai.torch_backend.ops.q1_weight import Q1Weight

    meta, k = torch.device("meta"), spec.config.hidden
    w = Q1Weight(
        signs=torch.empty(k, k // 32, dtype=torch.int32, device=meta),
        scales=torch.empty(k, k // 128, dtype=torch.float16, device=meta),
        rows=k,
        cols=k,
    )
    with recording() as launches, as_on_a_gpu(H100_SMS):
        for m in rows:
            acts = q1_exact.QuantizedRows.empty(m, k, meta)
            for kernel, options in GEMM_FORMS:
                q1_exact.linear_quantized(acts, w, kernel=kernel, split_k=1, **options)
    return launches


@dataclass
class Compiled:
    name: str
    constexprs: dict[str, Any]
    count: int
    registers: int
    spills: int
    loop: int
    ops: collections.Counter[str]
    per_weight_row: float | None
    waits_first: bool = True  # launched with PDL: griddepcontrol.wait (ACQBULK) precedes any memory access
    early_prefetches: int = 0  # L2 prefetch hints (CCTL...PF2) before that wait
    loop_loads: list[str] = field(default_factory=list)  # "position opcode" of the loop's global loads


def compile_launch(launch: Launch, arch: int) -> Compiled:
    kernel = compile_exactly(launch, arch)
    text = disassemble(kernel.asm["cubin"], "-sass")
    registers = int(re.search(r"REG:(\d+)", disassemble(kernel.asm["cubin"], "-res-usage")).group(1))
    instrs = [(int(a, 16), i.strip()) for a, i in re.findall(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", text)]
    body = group_work(instrs) if launch.fn.__name__ in GEMVS else longest_loop(instrs)
    ops = collections.Counter(opcode(i) for i in body)
    spills = sum(1 for _, i in instrs if re.search(r"\b(STL|LDL)\b", i))
    threads = 32 * kernel.metadata.num_warps
    pdl = bool(launch.options.get("launch_pdl"))
    waits = waits_first([i for _, i in instrs]) if pdl else True
    early = prefetches_before_wait([i for _, i in instrs]) if pdl else 0
    loads = [f"{k} {i.split()[1] if i.startswith('@') else i.split()[0]}" for k, i in enumerate(body)
             if opcode(i) == "LDG"]  # fmt: skip
    return Compiled(launch.fn.__name__, launch.constexprs, launch.count, registers, spills, len(body), ops,
                    gemv_cost(launch, len(body), threads), waits, early, loads)  # fmt: skip


def prefetches_before_wait(instrs: list[str]) -> int:
    """L2 prefetch hints (``prefetch.global.L2``: CCTL ... PF2) issued before the grid-dependency wait."""
    count = 0
    for ins in instrs:
        if opcode(ins) == "ACQBULK":
            return count
        count += opcode(ins) == "CCTL" and "PF2" in ins
    return count


def waits_first(instrs: list[str]) -> bool:
    """Whether the grid-dependency wait (``griddepcontrol.wait``: ACQBULK) comes before the first global
    or shared memory access, as a kernel launched with PDL needs."""
    memory = re.compile(r"^(@!?U?P\d+\s+)?(LDG|STG|LDGSTS|LDS|STS|ATOMG?|RED|UTMALDG|UBLKCP)\b")
    for ins in instrs:
        if opcode(ins) == "ACQBULK":
            return True
        if memory.match(ins):
            return False
    return False


def compile_exactly(launch: Launch, arch: int = ARCH) -> Any:
    """The launch compiled as the JIT would compile it (the same source, options and cache entry)."""
    src = ASTSource(fn=launch.fn, signature=launch.signature, constexprs=launch.source_constexprs,
                    attrs=launch.attrs)  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.options)


def disassemble(cubin: bytes, what: str) -> str:
    """``cuobjdump what`` of a cubin (``-sass``: the instructions; ``-res-usage``: registers, stack)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cmd = [str(BIN / "cuobjdump"), what, f.name]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def longest_loop(instrs: list[tuple[int, str]]) -> list[str]:
    """The instructions between the target of the longest backward branch and the branch."""
    best: list[str] = []
    for addr, ins in instrs:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            body = [i for a, i in instrs if int(m.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return best


GEMVS = ("_gemv_kernel", "_fast_gemv_kernel", "_gemv_split_kernel")


def group_work(instrs: list[tuple[int, str]]) -> list[str]:
    """A Q1 GEMV's work for one 128-group: its longest loop (the float GEMVs', and the exact GEMVs' where
    that loop holds their ``dp4a``s, IDP), else, where the JIT made the exact GEMV's group loop a single
    pass (one group per split: an int argument equal to 1 is a constant), the straight code from its
    first IDP to its last."""
    loop = longest_loop(instrs)
    at = [k for k, (_, i) in enumerate(instrs) if opcode(i) == "IDP"]
    if not at or any(opcode(i) == "IDP" for i in loop):
        return loop
    return [i for _, i in instrs[at[0] : at[-1] + 1]]  # the exact GEMV's single pass


def opcode(ins: str) -> str:
    words = ins.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def gemv_cost(launch: Launch, loop: int, threads: int) -> float | None:
    """SASS instructions per weight and activation row of a Q1 GEMV's group loop (one 128-group per
    row, activation row and split)."""
    c = launch.constexprs
    if launch.fn.__name__ not in GEMVS:
        return None
    rows = c["BLOCK_N"] * c["BLOCK_M"] * c.get("SPLITS", 1)
    groups = c.get("GROUP_CHUNK", 1)  # "gemv_split": a chunk of a split's groups is one straight stretch
    return loop * threads / (rows * groups * 128 * (2 if c["GATED"] else 1)) if loop else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="1.7b")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prefill", type=int, default=64)
    p.add_argument(
        "--q1",
        choices=Q1_ARITHMETICS,
        nargs="+",
        default=list(Q1_ARITHMETICS),
        help="the Q1 arithmetics whose op sets are compiled",
    )
    p.add_argument("--check", action="store_true", help="exit 1 on a compile error or a spill")
    p.add_argument(
        "--gemm-forms",
        type=int,
        nargs="+",
        metavar="ROWS",
        help="instead of the model's launches, the GEMM's forms (GEMM_FORMS) on its Q matrix at these rows",
    )
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter cannot compile kernels")
    launches = {}
    if args.gemm_forms:
        launches = gemm_form_launches(MODELS[args.model], tuple(args.gemm_forms))
    for q1 in args.q1 if not args.gemm_forms else ():
        launches.update(model_launches(MODELS[args.model], tuple(args.batches), args.prefill, q1))
    failures = 0
    head = f"{'kernel':<32} {'regs':>4} {'spill':>5} {'loop':>5} {'/w.row':>6} {'calls':>5}"
    print(f"{head}  constexprs; top ops")
    for launch in launches.values():
        try:
            k = compile_launch(launch, args.arch)
        except Exception as e:  # reported, and the rest still compile
            failures += 1
            print(f"{launch.fn.__name__:<32} FAILED {launch.constexprs}: {type(e).__name__}: {e}")
            continue
        failures += k.spills > 0 or not k.waits_first
        if not k.waits_first:
            print(f"{k.name:<32} touches memory before its grid-dependency wait (PDL) {k.constexprs}")
        cost = f"{k.per_weight_row:.2f}" if k.per_weight_row is not None else "-"
        top = ", ".join(f"{op} {n}" for op, n in k.ops.most_common(int(os.environ.get("SASS_TOP_OPS", "5"))))
        row = f"{k.name:<32} {k.registers:>4} {k.spills:>5} {k.loop:>5} {cost:>6} {k.count:>5}"
        early = f"; {k.early_prefetches} L2 prefetches before the PDL wait" if k.early_prefetches else ""
        print(f"{row}  {k.constexprs}; {top}{early}")
        if os.environ.get("SASS_LOOP_LOADS") and k.loop_loads:  # where the loop's global loads sit
            print(f"{'':<8}loop loads (of {k.loop}): {', '.join(k.loop_loads)}")
    print(f"{len(launches)} launches compiled for sm_{args.arch}, {failures} failed, spilled or touched "
          "memory before the PDL wait")  # fmt: skip
    if args.check and failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

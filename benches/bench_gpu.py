"""The first run on a lent GPU: every figure of research/gpu-path.md §7.4 that the torch path can give,
each speed beside a baseline measured in the same run, written as JSON to --out.

Sections (--sections picks some; each records its error and the run goes on):

- probe: torch/triton versions, the device, device-to-device copy GB/s (B1, bytes read + written),
  pinned host->device and device->host GB/s of one large copy.
- q1: the Triton ``q1_linear`` on random ``Q1Weight``s of the Bonsai-1.7B and 8B shapes at M in
  {1, 16, 64, 512}: GB/s of weight bytes (rows*cols*18/128) and its ratio to B1; B2 = fp16
  ``torch.matmul`` on the dequantized weight; relative error against ``ref_torch.q1_linear``. Timed in
  a CUDA graph over enough weight copies that they do not fit in L2 (eager time per call beside it).
  Its sweep of the exact kernel's forms gives a ``q1_tuned`` table of the forms that beat the
  defaults, written beside --out (``gpu.tuned.json``: copied into ``ops/tuned/`` it becomes the
  device's shipped table).
- decode: ``TorchQwen3.forward`` on random Bonsai-1.7B/8B-shaped weights over an fp16 ``KvPool``:
  decode tokens/s at batch 1/16/64 after a 512-token context (random KV written into the pool, not
  prefilled), eager and through ``DecodeGraphs`` (CUDA graphs per batch bucket; the last step's
  logits compared with eager's bit for bit), and prefill of 512 tokens (eager), each again with that
  table's forms where it has some for the model (``tuned_*``, or --tuned's table); B2 = the same
  forward with fp16 dense weights (dequantized; ~3.4 GB for 1.7B, ~16 GB for 8B).
- tier: promote GB/s of 64 scattered 1.7B-shaped blocks (``copy_blocks`` from a pinned host pool)
  against one large pinned copy of the same bytes, and the same for demotion; then, through
  ``oxibonsai.LLM(device="cuda", runner="torch")`` on a random Bonsai-1.7B-shaped GGUF, the TTFT of a
  request whose 1,024-token prefix was demoted to the host tier, against a cold prefill (and a device
  hit), with ``cache_stats()`` promotions as proof.
- engine: ``oxibonsai.LLM(device="cuda")`` end to end on a random Bonsai-1.7B-shaped GGUF: greedy
  decode tokens/s of 1/16/64 concurrent requests with CUDA graphs, with ``enforce_eager=True``, over
  the float Q1 kernels, with each step planned after the last one's tokens instead of launched ahead
  (``ahead_gain``), and that with each step's output work after its tokens too (``overlap_gain``), and
  whether all gave the same tokens; then one prompt's logits
  against the native CPU runner's on the same GGUF (relative L2 per row, top-1 agreement).

``--smoke`` runs all of it on the CPU with tiny shapes (the Triton q1 kernels under
``TRITON_INTERPRET=1``, the model on the reference ops) in about a minute, writing the same keys.
A global ``--budget-s`` skips what is left once spent. The lent machine has no Rust and no network, so
the lead builds ``.device/`` here first (it carries the native module and pure-Python wheels):

    bash scripts/device_bundle.sh
    # device tool: run(carry=[".device"], timeout_s=480,
    #                  command="bash .device/run.sh python3 benches/bench_gpu.py --out $OUT/gpu.json")
    python benches/bench_gpu.py --smoke --out /tmp/gpu-smoke.json   # here, on the CPU

``scripts/gpu_check.sh`` runs this within a budget between the CUDA-only tests and the whole torch test
suite, all in one device command (its header says how)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if "--smoke" in sys.argv:  # fixed when @triton.jit decorates, and the gpu package imports the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

# benches/ is sys.path[0] when this file runs as a script, so its gpu package imports by name.
from gpu.engine import engine_section
from gpu.models import decode_section
from gpu.plan import BONSAI_1P7B, BONSAI_8B, GPU_PLAN, SEED, SMOKE_PLAN, Plan
from gpu.q1 import q1_section, write_tuned_table
from gpu.report import table_lines, write_report
from gpu.tier import tier_section
from gpu.timing import Budget, free, guarded, probe

SECTIONS = ("probe", "q1", "decode", "tier", "engine")
SHARES = {"q1": 0.4, "decode": 0.8}  # of --budget-s: where q1 and decode stop starting new cases
NOTES = [
    "B1 = device-to-device copy GB/s counting bytes read + written; q1 GB/s counts weight bytes read",
    "decode is timed eager (tok_s) and as CUDA graph replays (graph_tok_s, inputs staged from the host "
    "each step); prefill is eager; decode context KV is random data written into the pool",
    "B2 = the same computation on fp16 dense (dequantized) weights with torch.matmul",
]


def run_sections(args: argparse.Namespace, plan: Plan, report: dict[str, Any]) -> None:
    device, budget = torch.device(plan.device), Budget(args.budget_s)
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "probe": lambda: probe(plan, device),
        "q1": lambda: q1_section(plan, device, budget.share(SHARES["q1"]), report_b1(report)),
        "decode": lambda: decode_section(
            plan, device, budget.share(SHARES["decode"]), tuned_table(args, report, device)
        ),
        "tier": lambda: tier_section(plan, device, budget),
        "engine": lambda: engine_section(plan, device, budget),
    }
    for name in SECTIONS:
        if name not in args.sections:
            continue
        print(f"[{budget.spent():6.1f} s] {name}", flush=True)
        start = time.perf_counter()
        report[name] = budget.skipped() if budget.over() else guarded(jobs[name])
        report[name]["seconds"] = time.perf_counter() - start
        report["meta"]["elapsed_s"] = budget.spent()
        write_report(args.out, report)
        free(device)


def tuned_table(args: argparse.Namespace, report: dict[str, Any], device: torch.device) -> Path | None:
    """The table of Q1 forms the decode section also times the model with: ``--tuned``, else the one
    this run's q1 sweep gives (written beside ``--out``), if any."""
    if args.tuned is not None:
        return Path(args.tuned)
    if "rows" not in report.get("q1", {}):
        return None
    path = write_tuned_table(report["q1"], args.out.with_suffix(".tuned.json"), device)
    report["q1"]["tuned_table"] = str(path) if path else None
    return path


def report_b1(report: dict[str, Any]) -> float | None:
    """B1 from the probe section, if it ran."""
    b1: float | None = report.get("probe", {}).get("d2d_gbps")
    return b1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (tests this script)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--models", nargs="+", choices=("1.7b", "8b"), default=["1.7b", "8b"],
                   help="GPU mode: which model shapes the q1 and decode sections use")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=330.0, help="skip what is left after this long")
    p.add_argument("--tuned", type=Path, help="a q1_tuned table for the decode section's tuned graphs "
                   "(default: the one this run's q1 sweep writes beside --out)")  # fmt: skip
    return p.parse_args()


def choose_plan(args: argparse.Namespace) -> Plan:
    if args.smoke:
        return SMOKE_PLAN
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --smoke for the CPU check")
    keep = {"1.7b": BONSAI_1P7B, "8b": BONSAI_8B}
    models = tuple(keep[name] for name in ("1.7b", "8b") if name in args.models)
    return dataclasses.replace(GPU_PLAN, models=models)


def main() -> None:
    args = parse_args()
    plan = choose_plan(args)
    # Fixed when @triton.jit decorates: set (or cleared) before any Triton kernel module is imported.
    if plan.device == "cuda":
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.manual_seed(SEED)
    report: dict[str, Any] = {"meta": {
        "mode": "smoke" if args.smoke else "gpu", "argv": sys.argv, "seed": SEED, "budget_s": args.budget_s,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"), "notes": NOTES,
    }}  # fmt: skip
    run_sections(args, plan, report)
    print("\n".join(table_lines(report)))
    print(f"wrote {args.out} in {report['meta'].get('elapsed_s', 0):.1f} s")


if __name__ == "__main__":
    main()

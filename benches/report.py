"""Markdown tables for BENCHMARKS.md from one pytest-benchmark JSON file (`--benchmark-json=FILE`).

Every ratio is computed between benchmarks of that one file, i.e. one run on one machine: speed-ups
against the sign-flip kernel and the two numpy baselines (same shape, residency, threads and n; >1 means
faster), and a kernel's cost per activation row against its own n=1 time. "% of bw" is the bytes an
implementation reads (Q1_0 bytes, or float32 bytes for numpy-f32) per second over the read bandwidth
measured in the same run. It reads the JSON only; it never runs anything.

    python benches/report.py results.json [--residency memory] [--threads 2] [--n 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

KERNEL_ORDER = ("gemm", "lut-gemm", "lut", "signflip", "numpy-q1", "numpy-f32")
BASELINES = ("signflip", "numpy-q1", "numpy-f32")


def load_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        if "kernel" in info:
            rows.append({**info, "mean": bench["stats"]["mean"]})
    return rows


def header(data: dict[str, Any]) -> list[str]:
    machine = data.get("machine_info", {})
    commit = data.get("commit_info", {})
    cpu = machine.get("cpu", {}).get("brand_raw") or machine.get("processor") or "unknown CPU"
    bandwidth = machine.get("read_bandwidth_gbs", {})
    dispatch = machine.get("oxibonsai_kernel_info", {})
    lines = [
        f"- Run: {data.get('datetime', '?')}, commit {str(commit.get('id', '?'))[:10]}"
        + (" (dirty)" if commit.get("dirty") else ""),
        f"- CPU: {cpu}; SIMD flags: {machine.get('simd_flags', '?')}",
        "- oxibonsai dispatch: " + ", ".join(f"{k}={v}" for k, v in dispatch.items() if k != "num_threads"),
        "- Read bandwidth (benches/bandwidth.py, same run): "
        + ", ".join(f"{t} thread(s) {gbs:.1f} GB/s" for t, gbs in sorted(bandwidth.items())),
    ]
    if machine.get("bench_quick"):
        lines.append("- **OXIBONSAI_BENCH_QUICK run: tiny shapes, the numbers mean nothing.**")
    return lines


def table(rows: list[dict[str, Any]], n: int | None) -> list[str]:
    """One residency and thread count; all its rows serve as baselines, those of batch `n` are shown."""
    by_key = {(r["shape"], r["n"], r["kernel"]): r for r in rows}
    lines = [
        "| shape | n | kernel | mean µs | weight GB/s | % of bw | vs signflip | vs numpy-q1 | vs numpy-f32 "
        "| row cost vs n=1 |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    order = {k: i for i, k in enumerate(KERNEL_ORDER)}
    shown = [r for r in rows if n is None or r["n"] == n]
    for r in sorted(shown, key=lambda r: (r["shape"], r["n"], order.get(r["kernel"], 99))):
        baselines = [by_key.get((r["shape"], r["n"], b)) for b in BASELINES]
        single = by_key.get((r["shape"], 1, r["kernel"]))
        cells = [
            r["shape"],
            str(r["n"]),
            r["kernel"],
            f"{r['mean'] * 1e6:,.1f}",
            f"{r['q1_bytes'] / r['mean'] / 1e9:.2f}",
            f"{r['pct_bandwidth']:.0f}%" if "pct_bandwidth" in r else "",
            *(f"{b['mean'] / r['mean']:.2f}x" if b else "" for b in baselines),
            f"{r['mean'] / r['n'] / single['mean']:.2f}" if single and r["n"] > 1 else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(data: dict[str, Any], residency: str | None, threads: int | None, n: int | None) -> str:
    rows = load_rows(data)
    out = header(data)
    for res, t in sorted({(r["residency"], r["threads"]) for r in rows}):
        if residency not in (None, res) or threads not in (None, t):
            continue
        out += ["", f"### {res}-resident, {t} thread(s)", ""]
        out += table([r for r in rows if r["residency"] == res and r["threads"] == t], n)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="output of pytest --benchmark-json")
    parser.add_argument("--residency", choices=("cache", "memory"))
    parser.add_argument("--threads", type=int)
    parser.add_argument("--n", type=int, help="only this batch size")
    args = parser.parse_args()
    print(report(json.loads(args.json.read_text()), args.residency, args.threads, args.n))


if __name__ == "__main__":
    main()

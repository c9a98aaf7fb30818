"""Scale-out benchmark: one shared-prefix serving workload against the single-process server and the
Ray Serve app (``oxibonsai serve --replicas N``) with prefix-affinity or power-of-two routing.

Configs, each a ``python -m oxibonsai serve`` subprocess alone on the machine (rounds alternate the
order; after each, the next waits until no ``raylet`` process is left):
- ``single``: the plain server (1 replica), ``--num-threads`` --single-threads (default 2);
- ``ray-prefix``: ``--replicas`` --replicas (2) ``--num-threads`` --replica-threads (1) ``--routing prefix``;
- ``ray-pow2``: the same with ``--routing pow2`` (Ray Serve's default router).
Workload: --groups prefixes of --prefix-len tokens; request i is group i % groups's prefix followed by a
unique --suffix-len-token suffix (groups interleave), --requests requests sent back to back by
--concurrency streams, --output-len tokens out, greedy with ignore_eos and min_tokens (bench_serve's
payload). Prompts are words that are one token each in the random model's vocabulary, as bench_serve's,
so a prefix is a whole number of tokens and its blocks are the same in every request of its group. A
few short unrelated warm-up requests (two per replica, as many streams as replicas) come first.
Per config: output tokens/s and requests/s over the run, TTFT p50/p90/p99, E2EL p50, the prefix hit rate
(growth of ``vllm:prefix_cache_hits_total`` summed over replicas / the same of
``vllm:prefix_cache_queries_total``, prompt tokens, from ``/metrics`` before and after the run) and each
replica's share of the queried tokens, the seconds until ``/v1/models`` answered and until the Ray
processes were gone, and the CPU the server's process tree and other processes used meanwhile.

    python benches/bench_scale_out.py [--rounds 1] [--requests 48] [--quick] [--json PATH]

--quick runs the tiny test model (tests/models.py; its vocabulary splits each word into ~2 tokens) on a
tiny workload: the whole plumbing in under a minute on a 2-core VM. The default run takes ~3 minutes there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from bench_model import CACHE_DIR, TESTS_DIR, machine_lines, untied_model_path
from serve_client import (
    Run,
    fixed_concurrency,
    summarize,
    word_prompts,
)
from serve_report import noise
from serve_servers import (
    RunningServer,
    ServerSpec,
    busy_cpu_s,
    completion_client,
    process_cpu_s,
    running_server,
)

CONFIGS = ("single", "ray-prefix", "ray-pow2")
RAY_GONE_TIMEOUT_S = 30.0
# Ray replicas post their metrics once a second (scale_out/replica.py): /metrics is read until two reads
# this far apart agree and every replica is there, for at most METRICS_SETTLE_TIMEOUT_S.
METRICS_SETTLE_S, METRICS_SETTLE_TIMEOUT_S = 1.5, 15.0
WARMUP_LEN, WARMUP_OUTPUT = 16, 4
METRICS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?:[^}]*?replica="([^"]*)")?[^}]*\})?\s+(\S+)')
QUICK = {
    "groups": 2,
    "prefix_len": 64,
    "suffix_len": 8,
    "requests": 8,
    "concurrency": 2,
    "output_len": 4,
    "max_model_len": 512,
    "rounds": 1,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a GGUF instead of the random Bonsai-1.7B-shaped one")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=1, help="alternations of the configs' order")
    p.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2, help="engine replicas of the ray-* configs")
    p.add_argument("--single-threads", type=int, default=2, help="--num-threads of the single server")
    p.add_argument("--replica-threads", type=int, default=1, help="--num-threads of each replica")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--json", type=Path, default=CACHE_DIR / "scale-out.json")
    p.add_argument("--log-dir", type=Path, default=CACHE_DIR / "scale-out-logs")
    p.add_argument("--quick", action="store_true", help="tiny model and workload: checks the plumbing")
    args = p.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.json = args.json.with_name(args.json.stem + "-quick.json")
    return args


def model_path(args: argparse.Namespace) -> Path:
    """--model; with --quick the tiny test model (written once); else bench_model's random Bonsai."""
    if args.model is not None or not args.quick:
        return untied_model_path(args.model)
    path = CACHE_DIR / "tiny-qwen3-random.gguf"
    if not path.exists():
        sys.path.insert(0, str(TESTS_DIR))
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".partial{os.getpid()}")
        importlib.import_module("models").write_tiny(partial, seed=0, tied=False)
        os.replace(partial, path)
    return path


def server_spec(name: str, path: Path, args: argparse.Namespace) -> ServerSpec:
    argv = [sys.executable, "-m", "oxibonsai", "serve", "--model", str(path)]
    argv += ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    argv += ["--disable-uvicorn-access-log"]
    if name == "single":
        return ServerSpec(name, [*argv, "--num-threads", str(args.single_threads)])
    routing = name.removeprefix("ray-")
    scale = ["--replicas", str(args.replicas), "--num-threads", str(args.replica_threads)]
    return ServerSpec(name, [*argv, *scale, "--routing", routing])


def build_prompts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(the run's prompts, request i on group i % groups; warm-up prompts sharing nothing with them)."""
    prefixes = word_prompts(500, args.groups, args.prefix_len)
    suffixes = word_prompts(501, args.requests, args.suffix_len)
    prompts = [prefixes[i % args.groups] + suffix for i, suffix in enumerate(suffixes)]
    return prompts, word_prompts(502, 2 * args.replicas, WARMUP_LEN)


def prefix_counters(text: str) -> dict[str, dict[str, float]]:
    """{replica label ("" for the single server): {metric: value}} for the prefix-cache counters."""
    counters: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in METRICS:
            replica = counters.setdefault(m.group(2) or "", {})
            replica[m.group(1)] = replica.get(m.group(1), 0.0) + float(m.group(3))
    return counters


async def settled_counters(client: httpx.AsyncClient, url: str, replicas: int) -> dict[str, dict[str, float]]:
    """The prefix-cache counters once they stopped moving (for the single server: at once)."""
    deadline = time.perf_counter() + METRICS_SETTLE_TIMEOUT_S
    last = prefix_counters((await client.get(url)).text)
    while "" not in last and time.perf_counter() < deadline:
        await asyncio.sleep(METRICS_SETTLE_S)
        current = prefix_counters((await client.get(url)).text)
        if current == last and len(current) >= replicas:
            break
        last = current
    return last


def hit_rate(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Cluster-wide hits / queries grown over the run, and each replica's share of the queries."""
    growth = {
        replica: {k: v - before.get(replica, {}).get(k, 0.0) for k, v in values.items()}
        for replica, values in after.items()
    }
    queries = sum(g.get(METRICS[0], 0.0) for g in growth.values())
    hits = sum(g.get(METRICS[1], 0.0) for g in growth.values())
    return {
        "queried_tokens": queries,
        "hit_tokens": hits,
        "hit_rate": hits / queries if queries else None,
        "replica_query_share": {
            r: g.get(METRICS[0], 0.0) / queries if queries else None for r, g in growth.items()
        },
    }


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and every live descendant (Ray's raylet, GCS and replica workers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += process_cpu_s(current)
        todo += children.get(current, [])
    return total


@contextlib.contextmanager
def tree_cpu_meter(server_pid: int) -> Iterator[dict[str, float]]:
    """serve_servers.cpu_meter's figures, with the server's whole process tree as the server."""
    figures: dict[str, float] = {}
    start = time.perf_counter(), *busy_cpu_s(), tree_cpu_s(server_pid), process_cpu_s(None)
    yield figures
    end = time.perf_counter(), *busy_cpu_s(), tree_cpu_s(server_pid), process_cpu_s(None)
    wall, busy, steal, server, client = (b - a for a, b in zip(start, end, strict=True))
    figures.update(
        wall_s=wall, server_cpu_s=server, bench_cpu_s=client, steal_s=steal,
        other_cpu_s=max(0.0, busy - server - client), cores=float(os.cpu_count() or 1),
    )  # fmt: skip


async def session(
    server: RunningServer, args: argparse.Namespace, prompts: list[str], warmup: list[str]
) -> dict[str, Any]:
    """Waits for the server, warms it up, then runs the workload between two reads of /metrics."""
    async with completion_client(server) as ready:
        client, model, ready_s, sender = ready.client, ready.model, ready.ready_s, ready.sender
        warm = await fixed_concurrency(sender(WARMUP_OUTPUT), warmup, args.replicas)
        metrics, replicas = f"{server.base_url}/metrics", 1 if server.spec.name == "single" else args.replicas
        before = await settled_counters(client, metrics, replicas)
        with tree_cpu_meter(server.process.pid) as cpu:
            run = await fixed_concurrency(sender(args.output_len), prompts, args.concurrency)
        after = await settled_counters(client, metrics, replicas)
    return {
        "model_id": model,
        "ready_s": ready_s,
        "warmup_failed": summarize(warm, {})["failed"],
        "run": run,
        "cache": hit_rate(before, after),
        "counters": {"before": before, "after": after},
        "cpu": cpu,
    }


def raylets() -> list[str]:
    found = subprocess.run(["pgrep", "-af", "raylet"], capture_output=True, text=True, check=False)
    return [line for line in found.stdout.splitlines() if line.strip()]


def wait_ray_gone() -> tuple[float, list[str]]:
    """(seconds until no raylet process was left, the ones still there after RAY_GONE_TIMEOUT_S)."""
    start = time.perf_counter()
    while (left := raylets()) and time.perf_counter() - start < RAY_GONE_TIMEOUT_S:
        time.sleep(0.5)
    return time.perf_counter() - start, left


def log_problems(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    return [line[:300] for line in lines if re.search(r"Traceback|\bERROR\b|Error:|\bFAILED\b", line)]


def run_config(name: str, path: Path, args: argparse.Namespace, index: int, prompts: Any) -> dict[str, Any]:
    log = args.log_dir / f"{name}-round{index + 1}.log"
    started = time.perf_counter()
    with running_server(server_spec(name, path, args), log) as server:
        result = asyncio.run(session(server, args, *prompts))
        stopping = time.perf_counter()
    result["stop_s"] = time.perf_counter() - stopping
    result["ray_gone_s"], result["ray_left"] = wait_ray_gone()
    result["total_s"] = time.perf_counter() - started
    result["exit_code"] = server.process.returncode
    result["log"], result["log_problems"] = str(log), log_problems(log)
    return result


def session_line(index: int, name: str, r: dict[str, Any]) -> str:
    s = summarize(r["run"], {})
    rate = r["cache"]["hit_rate"]
    left = f"; RAY LEFT: {len(r['ray_left'])} raylet(s)" if r["ray_left"] else ""
    return (
        f"round {index + 1} {name}: ready in {r['ready_s']:.1f} s, run {s['duration_s']:.1f} s, "
        f"{s['output_tokens_per_s']:.1f} tok/s, failed {s['failed']} (+{r['warmup_failed']} warm-up), hit "
        f"rate {'-' if rate is None else f'{rate:.1%}'}, stopped in {r['stop_s']:.1f} s (exit "
        f"{r['exit_code']}), Ray gone after {r['ray_gone_s']:.1f} s{left}, {len(r['log_problems'])} "
        f"error line(s) in {r['log']}; {noise(r['cpu'])}"
    )


TABLE_HEADER = (
    "| config | replicas x threads | requests | failed | output tok/s | req/s | TTFT ms p50 | TTFT ms p90 "
    "| TTFT ms p99 | E2EL ms p50 | prefix hit rate | queried tokens per replica | ready s |"
)


def table(rounds: list[dict[str, Any]], names: list[str], args: argparse.Namespace) -> list[str]:
    return [
        f"\n{args.groups} groups x {args.prefix_len}-token prefix + {args.suffix_len}-token unique suffix, "
        f"{args.requests} requests at {args.concurrency} streams, {args.output_len} tokens out "
        f"(pooled over {len(rounds)} round(s))\n",
        TABLE_HEADER,
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|",
        *(table_row(name, [r[name] for r in rounds], args) for name in names),
    ]


def table_row(name: str, results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One config pooled over rounds: requests together over summed time, hits / queries summed."""
    s = summarize(Run.pooled([r["run"] for r in results]), {})
    queries = sum(r["cache"]["queried_tokens"] for r in results)
    hits = sum(r["cache"]["hit_tokens"] for r in results)
    shares = [sorted(r["cache"]["replica_query_share"].values(), reverse=True) for r in results]
    threads = args.single_threads if name == "single" else args.replica_threads
    cells = [
        name,
        f"{1 if name == 'single' else args.replicas} x {threads}",
        str(s["completed"]),
        str(s["failed"]),
        f"{s['output_tokens_per_s']:.1f}",
        f"{s['requests_per_s']:.3f}",
        *(f"{s['ttft_ms'][k] or 0:.0f}" for k in ("p50", "p90", "p99")),
        f"{s['e2el_ms']['p50'] or 0:.0f}",
        f"{hits / queries:.1%}" if queries else "-",
        "; ".join(" / ".join(f"{v:.0%}" for v in share if v is not None) for share in shares),
        " / ".join(f"{r['ready_s']:.0f}" for r in results),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    args = parse_args()
    print("\n".join(machine_lines()), flush=True)
    path = model_path(args)
    prompts = build_prompts(args)
    print(f"model: {path}", flush=True)
    if left := raylets():
        print(f"warning: Ray already running before the first config: {left}", flush=True)
    start = time.perf_counter()
    rounds = []
    for index in range(args.rounds):
        order = args.configs if index % 2 == 0 else args.configs[::-1]
        result: dict[str, Any] = {"order": order}
        for name in order:
            result[name] = run_config(name, path, args, index, prompts)
            print(session_line(index, name, result[name]), flush=True)
        rounds.append(result)
    print(f"benchmark wall time: {time.perf_counter() - start:.0f} s")
    print("\n".join(table(rounds, args.configs, args)))
    serial = [
        {name: ({**r[name], "run": r[name]["run"].to_json({})} if name in CONFIGS else r[name]) for name in r}
        for r in rounds
    ]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine_lines(), "model": str(path), "rounds": serial}))
    print(f"raw figures: {args.json}")


if __name__ == "__main__":
    sys.exit(main())

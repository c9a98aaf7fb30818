"""Serving benchmark in the manner of ``vllm bench serve``: oxibonsai's OpenAI server against
llama-cpp-python's (``llama_cpp.server``) on the same GGUF, machine and thread count.

Each server runs as a subprocess, alone (never both loaded), and is polled until ``/v1/models``
answers; rounds alternate which goes first so that drift hits both. Every request is a streamed
``/v1/completions`` call, greedy, with ``ignore_eos`` and ``min_tokens`` = ``max_tokens`` so outputs
have the asked length; prompts are strings of words that are one token each in the random model's
vocabulary (llama-cpp-python accepts no token-id prompts), so both servers see the same token counts
(checked once per session with a non-streamed request's usage). Workloads, per server and round:

1. Fixed concurrency (--concurrency, default 1 4 16): that many streams send requests back to back,
   --input-len tokens in, --output-len out. Per request: TTFT (sent -> first chunk with text), ITL
   (gaps between text chunks), TPOT ((E2EL - TTFT) / (tokens - 1)), E2EL; p50/p90/p99 of each,
   output tokens/s and requests/s over the run, and goodput (requests/s meeting --goodput's SLOs).
2. Poisson arrivals at each --request-rate, --poisson-requests requests each.
3. Shared system prompt (SGLang's generated-shared-prefix): a --prefix-len-token prefix common to
   --prefix-requests prompts with unique --suffix-len-token suffixes, --prefix-concurrency streams,
   --prefix-output-len tokens out; the prefix is warmed by one request first. TTFT and the usage's
   ``cached_tokens`` where the server reports it.
4. HTTP overhead: the fixed-concurrency levels again on ``oxibonsai.AsyncLLM`` in this process (after
   our server has stopped), same prompts and engine arguments, after one warm-up request; output
   tokens/s HTTP / in process, the target taken at 16 streams.
Targets (printed with PASS/FAIL): at 16 streams ours >= 3x llama-cpp-python's output tokens/s; with the
shared prefix our TTFT p50 <= 1/5 of theirs; HTTP costs <= 5% of in-process tokens/s at 16 streams.
Each session also reports the CPU time other processes took meanwhile (a shared machine drifts).
The model is bench_model.py's random-weight GGUF with Bonsai-1.7B's shapes unless --model is given.
Prints the machine and command, a line per session, then markdown tables pooled over the rounds and
the targets with each ratio's median and range over rounds; --json gets every figure and request.

    python benches/bench_serve.py [--threads 2] [--rounds 1] [--quick] [--llama-python PATH]

The default run takes ~10 minutes on a 2-core VM, almost all of it llama-cpp-python's (one request at
a time, ~10 s per 128-in/64-out request); each further round adds as much.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_model import CACHE_DIR, machine_lines, untied_model_path
from serve_client import fixed_concurrency, generate_in_process, word_prompts
from serve_report import print_report, session_line
from serve_servers import (
    LLAMA,
    OURS,
    ServerSpec,
    available_servers,
    cpu_meter,
    http_session,
    running_server,
    server_specs,
)

import oxibonsai

WARMUP_LEN, WARMUP_OUTPUT = 16, 8
QUICK = {
    "concurrency": [1, 4],
    "input_len": 32,
    "output_len": 8,
    "min_prompts": 2,
    "request_rate": [2.0],
    "poisson_requests": 4,
    "prefix_len": 128,
    "prefix_requests": 4,
    "rounds": 1,
}


@dataclass
class Workload:
    """Every prompt of a round; the same for both servers and every round."""

    fixed: dict[int, list[str]]
    poisson: dict[float, list[str]]
    prefix_warm: str
    prefix: list[str]
    warmup: str
    sanity: str


def build_workload(args: argparse.Namespace) -> Workload:
    """Each workload gets its own seed, so no prompt repeats across levels (no accidental cache hits)."""
    fixed = {
        c: word_prompts(100 + c, max(args.min_prompts, c * args.prompts_per_stream), args.input_len)
        for c in args.concurrency
    }
    poisson = {
        rate: word_prompts(200 + i, args.poisson_requests, args.input_len)
        for i, rate in enumerate(args.request_rate)
    }
    system = word_prompts(300, 1, args.prefix_len)[0]
    prefixed = word_prompts(301, args.prefix_requests + 1, args.suffix_len, prefix=system)
    return Workload(
        fixed=fixed,
        poisson=poisson,
        prefix_warm=prefixed[0],
        prefix=prefixed[1:],
        warmup=word_prompts(400, 1, WARMUP_LEN)[0],
        sanity=word_prompts(401, 1, args.input_len)[0],
    )


def parse_slo(items: list[str]) -> dict[str, float]:
    slo = {}
    for item in items:
        metric, _, ms = item.partition(":")
        if metric not in ("ttft", "tpot", "e2el") or not ms:
            raise argparse.ArgumentTypeError(f"--goodput wants ttft:MS tpot:MS e2el:MS, got {item!r}")
        slo[metric] = float(ms)
    return slo


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a GGUF instead of the random Bonsai-1.7B-shaped one")
    p.add_argument("--threads", type=int, default=2, help="given to both servers")
    p.add_argument("--rounds", type=int, default=1, help="alternations of the two servers")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-stream", type=int, default=1, help="fixed-concurrency requests per stream")
    p.add_argument(
        "--min-prompts", type=int, default=2, help="fixed-concurrency requests per level, at least"
    )
    p.add_argument("--request-rate", type=float, nargs="*", default=[0.5, 2.0], help="Poisson rates, per s")
    p.add_argument("--poisson-requests", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--prefix-requests", type=int, default=16)
    p.add_argument("--prefix-concurrency", type=int, default=4)
    p.add_argument("--prefix-output-len", type=int, default=16)
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], help="SLOs, e.g. ttft:2000")
    p.add_argument("--max-num-seqs", type=int, help="ours (default: the highest concurrency, at least 16)")
    p.add_argument("--max-model-len", type=int, default=2048, help="ours; llama-cpp-python's n_ctx")
    p.add_argument("--max-waiting", type=int, help="ours: passed on when given")
    p.add_argument("--llama-python", type=Path, default=Path("/work/venvs/llamacpp/bin/python"))
    p.add_argument("--servers", nargs="+", choices=[OURS, LLAMA], default=[OURS, LLAMA])
    p.add_argument("--no-in-process", action="store_true", help="skip the HTTP-overhead run")
    p.add_argument("--json", type=Path, default=CACHE_DIR / "serve.json")
    p.add_argument("--log-dir", type=Path, default=CACHE_DIR / "serve-logs")
    p.add_argument("--quick", action="store_true", help="tiny workloads, one round: checks the plumbing")
    args = p.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.slo_ms = parse_slo(args.goodput)
    args.max_num_seqs = args.max_num_seqs or max(16, *args.concurrency)
    return args


async def in_process(path: Path, args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    """The fixed-concurrency levels on AsyncLLM directly, with our server's engine arguments, after the
    same warm-up, so the engine has the history the server had when it ran them."""
    engine = oxibonsai.AsyncLLM(
        str(path),
        num_threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        **({"max_waiting": args.max_waiting} if args.max_waiting else {}),
    )
    try:
        await generate_in_process(engine, work.warmup, WARMUP_OUTPUT, time.perf_counter())

        async def send(prompt: str, t0: float) -> Any:
            return await generate_in_process(engine, prompt, args.output_len, t0)

        return {"fixed": {c: await fixed_concurrency(send, work.fixed[c], c) for c in args.concurrency}}
    finally:
        engine.shutdown()


def run_round(
    index: int, specs: list[ServerSpec], path: Path, args: argparse.Namespace, work: Workload
) -> dict[str, Any]:
    """Every server in turn (the order flips each round), ours followed by its in-process run."""
    order = specs if index % 2 == 0 else specs[::-1]
    result: dict[str, Any] = {"order": [s.name for s in order]}
    for spec in order:
        log = args.log_dir / f"{spec.name}-round{index + 1}.log"
        with running_server(spec, log) as server, cpu_meter(server.process.pid) as cpu:
            result[spec.name] = asyncio.run(http_session(server, args, work))
        result[spec.name]["cpu"] = cpu
        print(session_line(index, spec.name, result[spec.name], args), flush=True)
        if spec.name == OURS and not args.no_in_process:
            gc.collect()
            with cpu_meter(None) as cpu:
                result["in_process"] = asyncio.run(in_process(path, args, work))
            result["in_process"]["cpu"] = cpu
            gc.collect()
            print(session_line(index, "in-process", result["in_process"], args), flush=True)
    return result


def main() -> None:
    args = parse_args()
    print("\n".join(machine_lines()), flush=True)
    path = untied_model_path(args.model)
    print(f"model: {path}")
    specs, notes = available_servers(server_specs(path, args), args)
    for note in notes:
        print(note)
    work = build_workload(args)
    start = time.perf_counter()
    rounds = [run_round(i, specs, path, args, work) for i in range(args.rounds)]
    print(f"benchmark wall time: {time.perf_counter() - start:.0f} s")
    report = print_report(rounds, specs, args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"machine": machine_lines(), "model": str(path), "notes": notes, **report})
    )
    print(f"raw figures: {args.json}")


if __name__ == "__main__":
    sys.exit(main())

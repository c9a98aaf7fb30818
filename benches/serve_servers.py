"""The servers ``bench_serve.py`` compares: their command lines, their lifetime as subprocesses, and one
session of every workload against a running server.

A server is started with its output in a log file, polled until ``/v1/models`` answers (its first
model id is the ``model`` of every request), and terminated (then killed if it lingers) before the next
one starts, so the two never share the machine. Nothing here computes a figure; see serve_client.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from serve_client import (
    RequestRecord,
    completion_payload,
    fixed_concurrency,
    poisson_arrivals,
    stream_completion,
)

if TYPE_CHECKING:
    from bench_serve import Workload

OURS, LLAMA = "oxibonsai", "llama-cpp-python"
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
WARMUP_OUTPUT = 8


@dataclass
class ServerSpec:
    name: str
    argv: list[str]  # without host and port


@dataclass
class RunningServer:
    spec: ServerSpec
    process: subprocess.Popen[bytes]
    base_url: str
    log: Path


def server_specs(path: Path, args: argparse.Namespace) -> dict[str, ServerSpec]:
    ours = [sys.executable, "-m", "oxibonsai", "serve", "--model", str(path)]
    ours += ["--num-threads", str(args.threads)]
    ours += ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    if args.max_waiting:
        ours += ["--max-waiting", str(args.max_waiting)]
    theirs = [str(args.llama_python), "-m", "llama_cpp.server", "--model", str(path)]
    theirs += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
    theirs += ["--n_ctx", str(args.max_model_len), "--verbose", "False"]
    # By default a new request cuts off the one streaming (it gets [DONE] early); benchmarks queue them.
    theirs += ["--interrupt_requests", "False"]
    return {OURS: ServerSpec(OURS, ours), LLAMA: ServerSpec(LLAMA, theirs)}


def available_servers(
    specs: dict[str, ServerSpec], args: argparse.Namespace
) -> tuple[list[ServerSpec], list[str]]:
    """The requested servers that can start here, and a note for each one skipped or caveat."""
    chosen, notes = [], []
    for name in args.servers:
        spec = specs[name]
        if name == LLAMA and not args.llama_python.exists():
            notes.append(f"llama-cpp-python: no {args.llama_python} (--llama-python): skipped")
        elif not starts(spec):
            notes.append(f"{name}: `{' '.join(module_argv(spec)[1:])} --help` failed: skipped")
        else:
            chosen.append(spec)
    if any(s.name == LLAMA for s in chosen):
        notes.append(
            "llama-cpp-python serves one request at a time (a global lock; --interrupt_requests False "
            "makes later requests wait instead of cutting the running stream short) and reuses its last "
            "prompt's KV cache for the longest common prefix; it ignores ignore_eos (min_tokens masks "
            "EOS instead) and stream_options, so its output tokens are counted as streamed text chunks."
        )
    return chosen, notes


def module_argv(spec: ServerSpec) -> list[str]:
    return spec.argv[: spec.argv.index("--model")]


def starts(spec: ServerSpec) -> bool:
    """Whether the server's module answers --help (ours may not be installed or written yet)."""
    probe = subprocess.run([*module_argv(spec), "--help"], capture_output=True, timeout=120, check=False)
    return probe.returncode == 0


def busy_cpu_s() -> tuple[float, float]:
    """(CPU seconds all processes have run, seconds stolen by the hypervisor) since boot."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds of this process (pid None) or of another one, all threads."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_meter(server_pid: int | None) -> Iterator[dict[str, float]]:
    """Fills the yielded dict with the CPU seconds used meanwhile by the server, this process and every
    other process (the last is noise: another job on a shared machine), plus hypervisor steal."""
    figures: dict[str, float] = {}
    start = time.perf_counter(), *busy_cpu_s(), process_cpu_s(server_pid), process_cpu_s(None)
    yield figures
    end = time.perf_counter(), *busy_cpu_s(), process_cpu_s(server_pid), process_cpu_s(None)
    wall, busy, steal, server, client = (b - a for a, b in zip(start, end, strict=True))
    if server_pid is None:
        server = 0.0
    figures.update(
        wall_s=wall, server_cpu_s=server, bench_cpu_s=client, steal_s=steal,
        other_cpu_s=max(0.0, busy - server - client), cores=float(os.cpu_count() or 1),
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(spec: ServerSpec, log: Path) -> Iterator[RunningServer]:
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        argv = [*spec.argv, "--host", "127.0.0.1", "--port", str(port)]
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield RunningServer(spec, process, f"http://127.0.0.1:{port}", log)
        finally:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def log_tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


async def wait_until_ready(client: httpx.AsyncClient, server: RunningServer) -> tuple[str, float]:
    """(the first model id /v1/models lists, seconds from start until it answered)."""
    start = time.perf_counter()
    while time.perf_counter() - start < READY_TIMEOUT_S:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.spec.name} exited ({server.process.returncode}):\n{log_tail(server.log)}"
            )
        with contextlib.suppress(httpx.TransportError):
            response = await client.get(f"{server.base_url}/v1/models", timeout=5.0)
            if response.status_code == 200:
                return response.json()["data"][0]["id"], time.perf_counter() - start
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{server.spec.name} not ready after {READY_TIMEOUT_S:.0f} s:\n{log_tail(server.log)}")


async def sanity_check(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> dict[str, Any]:
    """One non-streamed request: does the server count our prompt as we do, and give the asked length?"""
    payload = {**completion_payload(model, prompt, WARMUP_OUTPUT), "stream": False}
    del payload["stream_options"]
    response = await client.post(url, json=payload)
    body = response.json()
    usage = body.get("usage") or {}
    choice = (body.get("choices") or [{}])[0]
    return {
        "status": response.status_code,
        "prompt_words": prompt.count(" "),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "asked_tokens": WARMUP_OUTPUT,
        "finish_reason": choice.get("finish_reason"),
        "usage": usage,
    }


@contextlib.asynccontextmanager
async def completion_client(server: RunningServer) -> AsyncIterator[ReadyClient]:
    """A client of ``server`` once it answers, with its model id, the seconds it took, and
    ``sender(max_tokens)``: a streamed-completion sender for the workload drivers."""
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model, ready_s = await wait_until_ready(client, server)
        url = f"{server.base_url}/v1/completions"

        def sender(max_tokens: int) -> Any:
            async def send(prompt: str, t0: float) -> RequestRecord:
                return await stream_completion(client, url, completion_payload(model, prompt, max_tokens), t0)

            return send

        yield ReadyClient(client, url, model, ready_s, sender)


@dataclass(frozen=True)
class ReadyClient:
    client: httpx.AsyncClient
    url: str
    model: str
    ready_s: float
    sender: Callable[[int], Any]


async def http_session(server: RunningServer, args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    """Waits for the server, then runs every workload against it in turn."""
    async with completion_client(server) as ready:
        client, url, model, ready_s, sender = (
            ready.client,
            ready.url,
            ready.model,
            ready.ready_s,
            ready.sender,
        )
        warm = await sender(WARMUP_OUTPUT)(work.warmup, time.perf_counter())
        result: dict[str, Any] = {"model_id": model, "ready_s": ready_s, "warmup": warm}
        result["sanity"] = await sanity_check(client, url, model, work.sanity)
        send = sender(args.output_len)
        result["fixed"] = {c: await fixed_concurrency(send, work.fixed[c], c) for c in args.concurrency}
        result["poisson"] = {
            rate: await poisson_arrivals(send, work.poisson[rate], rate, seed=int(rate * 1000))
            for rate in args.request_rate
        }
        send_short = sender(args.prefix_output_len)
        result["prefix_warm"] = await send_short(work.prefix_warm, time.perf_counter())
        result["prefix"] = await fixed_concurrency(send_short, work.prefix, args.prefix_concurrency)
    return result

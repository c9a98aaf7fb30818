"""End-to-end speed of one Bonsai-1.7B-shaped model: prefill and decode tokens/s, against llama.cpp.

What it measures, for each thread count given:
- oxibonsai: `LLM(path, num_threads=n, max_model_len=1024).generate([prompt_ids], greedy, ignore_eos)`
  on a random prompt of --prompt-len token ids, --decode new tokens; prefill tokens/s, time to first
  token and decode tokens/s as the engine reports them in `RequestOutput.metrics`, plus the wall time.
- llama.cpp, when `llama_cpp` (llama-cpp-python) is importable: the same file and prompt, prefill timed
  as one `eval` of the prompt (n_batch 512), decode as --decode - 1 single-token `eval`s each followed
  by an argmax (the first new token comes from the prefill logits). Runs alternate ours/theirs per thread
  count so that both see the same machine state; ratios are ours / llama.cpp (> 1: we are faster).
  --rounds R repeats the whole alternation R times and ends with each ratio's median and range over
  the rounds (this machine's speed drifts by tens of percent between runs).
- Agreement: the logits of both engines on a short prompt (max and mean |difference|, logit scale,
  top-1 agreement overall and where llama.cpp's top-2 gap exceeds 0.5).
The model is a random-weight GGUF with Bonsai-1.7B's exact shapes (tests/model_factory.py, ~290 MB
untied, --tied for a shared embedding/LM head), written once under /tmp/oxibonsai-bench and reused when
--keep leaves it there; --model PATH benchmarks any file instead (a real Bonsai model, say). Random
weights run the same arithmetic as trained ones, so speed is representative; text is not.
Each engine gets one short warm-up generation first (page cache, thread pool). The output starts with
the machine (CPU, cores, SIMD flags, date) and the exact command line.

    python benches/bench_model.py --threads 1 2 --prompt-len 512 --decode 128 [--model PATH] [--keep]
        [--rounds R]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

import oxibonsai

CACHE_DIR = Path("/tmp/oxibonsai-bench")
CACHE_VERSION = "v1"  # bump when model_factory changes what it writes, so a stale cache is not reused
TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
MAX_MODEL_LEN = 1024
WARMUP_PROMPT, WARMUP_DECODE = 8, 2
LOGITS_PROMPT = 16
FLAG_PREFIXES = ("avx2", "avx512", "avx_vnni", "fma", "f16c", "amx", "asimd", "sve", "i8mm", "dotprod")


@dataclass
class Result:
    engine: str
    threads: int
    prefill_tps: float
    ttft_s: float
    decode_tps: float
    wall_s: float


def machine_lines() -> list[str]:
    try:
        info = dict(
            (key.strip(), value.strip())
            for key, _, value in (
                line.partition(":") for line in Path("/proc/cpuinfo").read_text().splitlines()
            )
            if key.strip() in ("model name", "flags", "Features")
        )  # the first CPU's lines win: later ones repeat them
    except OSError:
        info = {}
    cpu = info.get("model name") or platform.processor() or platform.machine()
    found = (info.get("flags") or info.get("Features") or "").split()
    flags = " ".join(sorted(f for f in found if f.startswith(FLAG_PREFIXES)))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    kernel_info = getattr(oxibonsai, "kernel_info", None)
    return [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"machine: {cpu}; {os.cpu_count()} logical CPUs, {usable} usable; {platform.platform()}",
        f"SIMD flags: {flags or 'unknown'}",
        f"oxibonsai kernels: {kernel_info() if kernel_info else 'n/a'}",
        f"command: {shlex.join([sys.executable, *sys.argv])}",
    ]


def write_random_model(path: Path, tied: bool) -> None:
    """Bonsai-1.7B shapes, fixed seed; written beside the target and renamed, so no reader sees half."""
    sys.path.insert(0, str(TESTS_DIR))
    factory = importlib.import_module("model_factory")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".partial{os.getpid()}")
    print(f"writing {path} ...", flush=True)
    factory.write_qwen3_gguf(partial, factory.bonsai_1p7b_config(), np.random.default_rng(0), tied=tied)
    os.replace(partial, path)


def untied_model_path(model: Path | None) -> Path:
    """`model`, or the random Bonsai-1.7B-shaped GGUF with an untied output (written on first use)."""
    if model is not None:
        return model
    path = CACHE_DIR / f"bonsai-1.7b-random-untied-{CACHE_VERSION}.gguf"
    if not path.exists():
        write_random_model(path, tied=False)
    return path


def vocab_size(path: Path) -> int:
    embd = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    return int(embd.shape[1])


def bench_ours(path: Path, threads: int, prompt: list[int], decode: int) -> Result:
    llm = oxibonsai.LLM(str(path), num_threads=threads, max_model_len=MAX_MODEL_LEN)
    warm = oxibonsai.SamplingParams(max_tokens=WARMUP_DECODE, temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:WARMUP_PROMPT]], warm)
    params = oxibonsai.SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    wall = time.perf_counter() - start
    m = out.metrics
    del llm
    gc.collect()
    return Result(
        "oxibonsai", threads, m.prefill_tokens_per_s, m.time_to_first_token, m.decode_tokens_per_s, wall
    )


def llama_cpp_module() -> Any:
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        return None


def last_logits(lc: Any, llm: Any) -> np.ndarray:
    """The logits of the last evaluated token (the only output row when logits_all is off)."""
    return np.ctypeslib.as_array(lc.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))


def bench_llama_cpp(lc: Any, path: Path, threads: int, prompt: list[int], decode: int) -> Result:
    llm = lc.Llama(
        model_path=str(path),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=MAX_MODEL_LEN,
        n_batch=512,
        logits_all=False,
        verbose=False,
    )
    llm.eval(prompt[:WARMUP_PROMPT])
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    token = int(np.argmax(last_logits(lc, llm)))
    prefill = time.perf_counter() - start
    for _ in range(decode - 1):
        llm.eval([token])
        token = int(np.argmax(last_logits(lc, llm)))
    wall = time.perf_counter() - start
    del llm
    gc.collect()
    return Result("llama.cpp", threads, len(prompt) / prefill, prefill, (decode - 1) / (wall - prefill), wall)


def compare_logits(lc: Any, path: Path, ids: list[int], threads: int) -> list[str]:
    ours = np.asarray(oxibonsai.LLM(str(path), num_threads=threads, max_model_len=MAX_MODEL_LEN).logits(ids))
    llm = lc.Llama(
        model_path=str(path), n_threads=threads, n_ctx=MAX_MODEL_LEN, logits_all=True, verbose=False
    )
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)
    diff = np.abs(ours.astype(np.float64) - theirs)
    top2 = np.sort(theirs, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.5
    agree = ours.argmax(1) == theirs.argmax(1)
    return [
        f"logits on a {len(ids)}-token prompt: max |ours - llama.cpp| {diff.max():.4f}, "
        f"mean {diff.mean():.4f}, llama.cpp logit std {theirs.std():.3f}",
        f"top-1 agreement {agree.sum()}/{len(ids)}; where llama.cpp's top-2 gap > 0.5: "
        f"{agree[clear].sum()}/{clear.sum()}",
    ]


def table(results: list[Result]) -> list[str]:
    lines = [
        "| threads | engine | prefill tok/s | TTFT s | decode tok/s | wall s "
        "| prefill ours/llama.cpp | decode ours/llama.cpp |",
        "|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    theirs = {r.threads: r for r in results if r.engine == "llama.cpp"}
    for r in results:
        base = theirs.get(r.threads) if r.engine == "oxibonsai" else None
        ratios = (
            [f"{r.prefill_tps / base.prefill_tps:.2f}x", f"{r.decode_tps / base.decode_tps:.2f}x"]
            if base
            else ["", ""]
        )
        cells = [
            str(r.threads),
            r.engine,
            f"{r.prefill_tps:,.1f}",
            f"{r.ttft_s:.3f}",
            f"{r.decode_tps:,.2f}",
            f"{r.wall_s:.2f}",
        ]
        lines.append("| " + " | ".join(cells + ratios) + " |")
    return lines


def ratio_summary(rounds: list[list[Result]]) -> list[str]:
    """Per thread count: the median over rounds of ours / llama.cpp, each ratio taken within a round."""
    lines = []
    for threads in sorted({r.threads for r in rounds[0]}):
        pairs = []
        for results in rounds:
            by_engine = {r.engine: r for r in results if r.threads == threads}
            pairs.append((by_engine["oxibonsai"], by_engine["llama.cpp"]))
        for what, key in (("prefill", "prefill_tps"), ("decode", "decode_tps")):
            ratios = sorted(getattr(ours, key) / getattr(theirs, key) for ours, theirs in pairs)
            lines.append(
                f"{threads} thread(s), {what} ours/llama.cpp over {len(ratios)} rounds: median "
                f"{statistics.median(ratios):.2f}x, range {ratios[0]:.2f}-{ratios[-1]:.2f}x"
            )
    return lines


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument(
        "--model", type=Path, help="benchmark this GGUF instead of a random Bonsai-1.7B-shaped one"
    )
    p.add_argument("--tied", action="store_true", help="random model with a tied embedding / LM head")
    p.add_argument("--keep", action="store_true", help="leave the random model in the cache for later runs")
    p.add_argument(
        "--rounds", type=int, default=1, help="repeat ours and llama.cpp in turn; ratios taken within a round"
    )
    args = p.parse_args()
    if args.prompt_len + args.decode > MAX_MODEL_LEN or args.prompt_len < WARMUP_PROMPT or args.decode < 2:
        p.error(f"need {WARMUP_PROMPT} <= prompt-len, 2 <= decode, prompt-len + decode <= {MAX_MODEL_LEN}")
    return args


def resolve_model(args: argparse.Namespace) -> tuple[Path, bool]:
    """(path, whether to delete it at the end)."""
    if args.model is not None:
        return args.model, False
    path = CACHE_DIR / f"bonsai-1.7b-random-{'tied' if args.tied else 'untied'}-{CACHE_VERSION}.gguf"
    if path.exists():
        print(f"reusing {path}")
        return path, False
    write_random_model(path, args.tied)
    return path, not args.keep


def main() -> None:
    args = parse_args()
    print("\n".join(machine_lines()), flush=True)
    path, remove = resolve_model(args)
    try:
        prompt = np.random.default_rng(1).integers(0, vocab_size(path), args.prompt_len).tolist()
        lc = llama_cpp_module()
        print(f"model: {path}")
        if lc is None:
            print("llama.cpp: llama-cpp-python not installed: oxibonsai only")
        else:
            info = lc.llama_print_system_info()
            print(f"llama.cpp: llama-cpp-python {lc.__version__}; {info.decode(errors='replace').strip()}")
        rounds = []
        for r in range(args.rounds):
            results = []
            for n in args.threads:
                results.append(bench_ours(path, n, prompt, args.decode))
                if lc is not None:
                    results.append(bench_llama_cpp(lc, path, n, prompt, args.decode))
            if args.rounds > 1:
                print(f"round {r + 1} of {args.rounds}:")
            print("\n".join(table(results)), flush=True)
            rounds.append(results)
        if lc is not None and args.rounds > 1:
            print("\n".join(ratio_summary(rounds)))
        if lc is not None:
            print("\n".join(compare_logits(lc, path, prompt[:LOGITS_PROMPT], args.threads[0])))
    finally:
        if remove:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

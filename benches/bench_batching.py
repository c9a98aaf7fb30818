"""Continuous batching on the Bonsai-1.7B-shaped random model of ``bench_model.py``.

- Decode throughput with 1, 4, 16 and 64 concurrent requests (--concurrency): each request has a
  --prompt-len-token random prompt and generates --decode tokens; aggregate tokens/s over the steps
  that only decode (every running request, one token each), so prefill does not blur it.
  Target: 16 concurrent requests give >= 6x the tokens/s of one. The levels run in turn, --rounds
  times, and each ratio is taken within a round (one request's speed swings between runs on a noisy
  machine): the table gives the median over rounds and the range.
- Scheduler overhead: the time inside the native ``schedule()`` + ``update()`` as a share of each
  decode step (target <= 2% at 64 running), and the whole Python side of a step (sampling,
  detokenizing, bookkeeping: everything but the forward pass) for comparison.
- A Poisson arrival workload like ``vllm bench serve``: --requests requests at --rate per second,
  prompt and output lengths uniform in [--min-len, --max-len] and [--min-out, --max-out]; TTFT and
  time per output token percentiles, request and token throughput.
Every request is greedy unless --temperature is given (then sampled, seeded; with --top-p too). Prints
the machine and command first.

    python benches/bench_batching.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_model import machine_lines, untied_model_path, vocab_size

import oxibonsai


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=3, help="times each concurrency level runs, in turn")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--requests", type=int, default=48, help="of the Poisson workload (0: no Poisson run)")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--min-out", type=int, default=8)
    p.add_argument("--max-out", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16, help="for the Poisson workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="of every request (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="of every sampled request")
    p.add_argument("--model", type=Path, help="a GGUF instead of the random Bonsai-1.7B-shaped one")
    return p.parse_args()


class TimedScheduler:
    """Wraps the engine's native scheduler and adds up the time spent in schedule() and update()."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seconds = 0.0

    def schedule(self) -> Any:
        t = time.perf_counter()
        out = self._inner.schedule()
        self.seconds += time.perf_counter() - t
        return out

    def update(self, out: Any, sampled: Any) -> None:
        t = time.perf_counter()
        self._inner.update(out, sampled)
        self.seconds += time.perf_counter() - t

    def execute(self, out: Any) -> Any:
        t = time.perf_counter()
        logits = self._inner.execute(out)
        self.forward_seconds = time.perf_counter() - t
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def make_llm(path: Path, args: argparse.Namespace, seqs: int) -> oxibonsai.LLM:
    return oxibonsai.LLM(
        str(path),
        num_threads=args.threads,
        max_model_len=1024,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(256, seqs),
        enable_prefix_caching=False,
    )


def decode_run(path: Path, args: argparse.Namespace, seqs: int, vocab: int) -> dict[str, float]:
    """Decode tokens/s with `seqs` requests decoding together, and the overhead shares."""
    llm = make_llm(path, args, seqs)
    engine = llm._engine
    timed = TimedScheduler(engine._sched)
    engine._sched = timed
    rng = np.random.default_rng(args.seed)
    params = oxibonsai.SamplingParams(
        max_tokens=args.decode,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=True,
    )
    for i in range(seqs):
        engine.add_request(str(i), None, [int(t) for t in rng.integers(0, vocab, args.prompt_len)], params)
    step_s, sched_s, python_s, tokens = [], [], [], 0
    while engine.has_unfinished():
        before = engine.scheduler_stats()
        timed.seconds, timed.forward_seconds = 0.0, 0.0
        t = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t
        after = engine.scheduler_stats()
        decoded = after["decode_tokens"] - before["decode_tokens"]
        if after["prefill_tokens"] == before["prefill_tokens"] and decoded == seqs:
            step_s.append(elapsed)
            sched_s.append(timed.seconds)
            python_s.append(elapsed - timed.forward_seconds)
            tokens += decoded
    total = sum(step_s)
    return {
        "seqs": seqs,
        "steps": len(step_s),
        "tok_s": tokens / total,
        "step_ms": 1000 * statistics.median(step_s),
        "best_ms": 1000 * min(step_s),
        "sched_pct": 100 * sum(sched_s) / total,
        "python_pct": 100 * sum(python_s) / total,
    }


def throughput_table(path: Path, args: argparse.Namespace, vocab: int) -> list[str]:
    """One line per concurrency level: medians over the rounds; ratios to the first level are taken
    within each round (median, and the range over rounds)."""
    rounds = [[decode_run(path, args, c, vocab) for c in args.concurrency] for _ in range(args.rounds)]
    lines = [
        f"Decode throughput, {args.rounds} rounds of the levels in turn (medians; ratios within a round):",
        "| concurrent | decode steps | median step ms | tokens/s | vs first (range) | fastest step ms "
        "| tokens/s at fastest | vs first (range) | schedule+update | python side |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level in range(len(args.concurrency)):
        runs = [r[level] for r in rounds]
        ratio = [r[level]["tok_s"] / r[0]["tok_s"] for r in rounds]
        fastest = [
            (r[level]["seqs"] / r[level]["best_ms"]) / (r[0]["seqs"] / r[0]["best_ms"]) for r in rounds
        ]

        def med(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(run[key] for run in runs)

        lines.append(
            f"| {args.concurrency[level]} | {int(med('steps'))} | {med('step_ms'):.1f} | {med('tok_s'):.1f} "
            f"| {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) | {med('best_ms'):.1f} "
            f"| {args.concurrency[level] / med('best_ms') * 1000:.1f} "
            f"| {statistics.median(fastest):.2f}x ({min(fastest):.2f}-{max(fastest):.2f}) "
            f"| {med('sched_pct'):.3f}% | {med('python_pct'):.2f}% |"
        )
    return lines


def percentiles(values: list[float]) -> str:
    q = np.percentile(np.array(values) * 1000, [50, 90, 99])
    return f"mean {1000 * statistics.fmean(values):.0f} / p50 {q[0]:.0f} / p90 {q[1]:.0f} / p99 {q[2]:.0f} ms"


def poisson_run(path: Path, args: argparse.Namespace, vocab: int) -> list[str]:
    """Requests arrive by a Poisson process and are served by the step loop as they come."""
    llm = make_llm(path, args, args.max_num_seqs)
    engine = llm._engine
    rng = np.random.default_rng(args.seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.requests))
    work = [
        (
            float(at),
            [int(t) for t in rng.integers(0, vocab, int(rng.integers(args.min_len, args.max_len + 1)))],
            oxibonsai.SamplingParams(
                max_tokens=int(rng.integers(args.min_out, args.max_out + 1)),
                temperature=args.temperature,
                top_p=args.top_p,
                ignore_eos=True,
            ),
        )
        for at in arrivals
    ]
    done: list[oxibonsai.RequestOutput] = []
    start = time.perf_counter()
    pending = list(reversed(work))
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[-1][0] <= now:
            _, ids, params = pending.pop()
            engine.add_request(str(len(work) - len(pending)), None, ids, params)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[-1][0] - now))
            continue
        done += [o for o in engine.step() if o.finished]
    wall = time.perf_counter() - start
    ttft = [o.metrics.time_to_first_token for o in done]
    tpot = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (o.metrics.num_generated_tokens - 1)
        for o in done
        if o.metrics.num_generated_tokens > 1
    ]
    out_tokens = sum(o.metrics.num_generated_tokens for o in done)
    in_tokens = sum(o.metrics.num_prompt_tokens for o in done)
    return [
        f"Poisson workload: {len(done)} requests at {args.rate}/s, "
        f"prompts {args.min_len}-{args.max_len} tokens, outputs {args.min_out}-{args.max_out}, "
        f"max_num_seqs={args.max_num_seqs}",
        f"- wall {wall:.1f} s; {len(done) / wall:.2f} requests/s; output {out_tokens / wall:.1f} tokens/s; "
        f"total {(in_tokens + out_tokens) / wall:.1f} tokens/s; preemptions "
        f"{engine.scheduler_stats()['preemptions']}",
        f"- TTFT: {percentiles([t for t in ttft if t is not None])}",
        f"- TPOT: {percentiles(tpot)}",
    ]


def main() -> None:
    args = parse_args()
    path = untied_model_path(args.model)
    vocab = vocab_size(path)
    print("\n".join(machine_lines()), flush=True)
    print("\n".join(throughput_table(path, args, vocab)), flush=True)
    if args.requests > 0:
        print("\n".join(poisson_run(path, args, vocab)), flush=True)


if __name__ == "__main__":
    main()

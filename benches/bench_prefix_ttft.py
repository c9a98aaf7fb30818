"""Prefix caching end to end on the Bonsai-1.7B-shaped random model of ``bench_model.py``.

- TTFT: a prompt of a --prefix-len-token prefix (1,024) plus a --suffix-len-token suffix, cold (cache
  off, and cache on but empty), then with the prefix cached (new suffixes, median of --repeats).
  Target: cached TTFT <= 5% of cold (plus the suffix's own cost).
- Shared system prompt: --requests requests, one after another, each a --system-len-token system prompt
  plus its own 32-token question, one generated token each: hit rate and total prefill time (sum of
  TTFTs), cache on and off.
- Multi-turn chat: --turns turns; each resends the whole history (system prompt, earlier questions and
  replies) plus a new 32-token question and generates 16 tokens: hit rate and total prefill time, on
  and off (the greedy replies must agree).
Requests run one at a time (as if arriving apart), so TTFT is prefill time. Prints the machine and
command first.

    python benches/bench_prefix_ttft.py --threads 2 [--model PATH]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_model import machine_lines, untied_model_path, vocab_size

import oxibonsai

QUESTION, REPLY = 32, 16
Ids = Callable[[int], list[int]]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--model", type=Path, help="a GGUF instead of the random Bonsai-1.7B-shaped one")
    return p.parse_args()


class Run:
    """One LLM, cache on or off, and the requests' TTFTs."""

    def __init__(self, path: Path, args: argparse.Namespace, cache: bool) -> None:
        self.llm = oxibonsai.LLM(
            str(path),
            num_threads=args.threads,
            max_model_len=2048,
            max_num_seqs=1,
            enable_prefix_caching=cache,
        )
        self.llm.generate([[1, 2, 3]], oxibonsai.SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        self.llm.reset_prefix_cache()
        self.base = self.llm.cache_stats()

    def request(self, ids: list[int], max_tokens: int = 1) -> tuple[float, list[int]]:
        params = oxibonsai.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = self.llm.generate([ids], params)[0]
        ttft = out.metrics.time_to_first_token
        assert ttft is not None
        return ttft, out.outputs[0].token_ids

    def hit_rate(self) -> str:
        s = self.llm.cache_stats()
        hit, queried = (
            s["hit_tokens"] - self.base["hit_tokens"],
            s["queried_tokens"] - self.base["queried_tokens"],
        )
        computed = s["computed_tokens"] - self.base["computed_tokens"]
        rate = f"{hit / queried:.1%}" if queried else "n/a"
        return f"{rate} ({hit}/{queried} prompt tokens cached); {computed} tokens computed"


def ttft(path: Path, args: argparse.Namespace, ids: Ids) -> list[str]:
    prefix = ids(args.prefix_len)
    off = Run(path, args, cache=False).request(prefix + ids(args.suffix_len))[0]
    on = Run(path, args, cache=True)
    miss = on.request(prefix + ids(args.suffix_len))[0]
    cached = statistics.median(on.request(prefix + ids(args.suffix_len))[0] for _ in range(args.repeats))
    n = args.prefix_len + args.suffix_len
    return [
        f"### TTFT, {args.prefix_len}-token cached prefix + {args.suffix_len}-token suffix ({n} tokens)",
        "| run | TTFT s | of cold |",
        "|---|--:|--:|",
        f"| cold, cache off | {off:.3f} | 100% |",
        f"| cold, cache on (miss) | {miss:.3f} | {miss / off:.1%} |",
        f"| prefix cached (median of {args.repeats}) | {cached:.3f} | {cached / off:.2%} |",
    ]


def shared_system(path: Path, args: argparse.Namespace, ids: Ids) -> list[str]:
    system = ids(args.system_len)
    prompts = [system + ids(QUESTION) for _ in range(args.requests)]
    rows = []
    for cache in (False, True):
        run = Run(path, args, cache)
        total = sum(run.request(p)[0] for p in prompts)
        rows.append(f"| {'on' if cache else 'off'} | {total:.3f} | {run.hit_rate()} |")
    return [
        f"### Shared system prompt: {args.requests} requests of {args.system_len} + {QUESTION} tokens",
        "| cache | total prefill s | hit rate |",
        "|---|--:|---|",
        *rows,
    ]


def multi_turn(path: Path, args: argparse.Namespace, ids: Ids) -> list[str]:
    system = ids(128)
    questions = [ids(QUESTION) for _ in range(args.turns)]
    rows, replies = [], []
    for cache in (False, True):
        run = Run(path, args, cache)
        history, total, got = list(system), 0.0, []
        for q in questions:
            history += q
            t, reply = run.request(history, REPLY)
            total += t
            got.append(reply)
            history += reply
        replies.append(got)
        rows.append(f"| {'on' if cache else 'off'} | {total:.3f} | {run.hit_rate()} |")
    assert replies[0] == replies[1], "cached and uncached replies differ"
    return [
        f"### Multi-turn chat: {args.turns} turns, 128-token system prompt, {QUESTION}-token questions, "
        f"{REPLY}-token replies",
        "| cache | total prefill s | hit rate |",
        "|---|--:|---|",
        *rows,
    ]


def main() -> None:
    args = parse_args()
    print("\n".join(machine_lines()), flush=True)
    path = untied_model_path(args.model)
    print(f"model: {path}; threads: {args.threads}", flush=True)
    rng = np.random.default_rng(0)
    vocab = vocab_size(path)

    def ids(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    for part in (ttft, shared_system, multi_turn):
        print("\n".join(part(path, args, ids)), flush=True)


if __name__ == "__main__":
    main()

"""What ``bench_serve.py`` prints and saves: a line per session, markdown tables pooled over the rounds,
ratios ours / llama-cpp-python taken within each round (median and range over rounds), the issue's
targets with PASS/FAIL, and the JSON form of every run (figures plus each request's raw record)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from serve_client import RequestRecord, Run, summarize
from serve_servers import LLAMA, OURS, ServerSpec

TARGET_SPEEDUP, TARGET_PREFIX_TTFT, TARGET_HTTP_COST = 3.0, 0.2, 0.05
NOISY_SHARE = 0.05  # of the machine's CPU time taken by other processes during a session


def ms3(quantiles: dict[str, float | None]) -> str:
    if quantiles["p50"] is None:
        return "-"
    return " / ".join(f"{quantiles[k]:.0f}" for k in ("p50", "p90", "p99"))  # type: ignore[str-format]


def noise(cpu: dict[str, float]) -> str:
    """How much CPU other processes took during a session: benchmarks on a shared machine drift."""
    share = cpu["other_cpu_s"] / (cpu["wall_s"] * cpu["cores"])
    warning = " (NOISY: another job shared the machine)" if share > NOISY_SHARE else ""
    return (
        f"{cpu['wall_s']:.0f} s; other processes used {cpu['other_cpu_s']:.1f} CPU-s ({share:.1%} of the "
        f"machine){warning}, steal {cpu['steal_s']:.1f} s"
    )


def session_line(index: int, name: str, result: dict[str, Any], args: argparse.Namespace) -> str:
    fixed = ", ".join(f"{c} streams {tok_s(run, args):.1f} tok/s" for c, run in result["fixed"].items())
    if name == "in-process":
        return f"round {index + 1} in-process AsyncLLM: {fixed}; {noise(result['cpu'])}"
    prefix = summarize(result["prefix"], args.slo_ms)
    failed = sum(summarize(run, args.slo_ms)["failed"] for run in all_runs(result))
    return (
        f"round {index + 1} {name} (ready in {result['ready_s']:.1f} s): {fixed}; shared-prefix TTFT p50 "
        f"{prefix['ttft_ms']['p50'] or 0:.0f} ms; failed requests {failed}; {noise(result['cpu'])}"
    )


def all_runs(result: dict[str, Any]) -> list[Run]:
    return [*result["fixed"].values(), *result["poisson"].values(), result["prefix"]]


def pooled(rounds: list[dict[str, Any]], name: str, pick: Callable[[dict[str, Any]], Run]) -> Run:
    return Run.pooled([pick(r[name]) for r in rounds if name in r])


def load_row(label: list[str], s: dict[str, Any]) -> str:
    cells = [
        *label,
        f"{s['completed']}",
        f"{s['failed']}",
        f"{s['output_tokens_per_s']:.1f}",
        f"{s['requests_per_s']:.3f}",
        f"{s['goodput_requests_per_s']:.3f}",
        ms3(s["ttft_ms"]),
        ms3(s["tpot_ms"]),
        ms3(s["itl_ms"]),
        ms3(s["e2el_ms"]),
    ]
    return "| " + " | ".join(cells) + " |"


LOAD_HEADER = (
    "| requests | failed | output tok/s | req/s | goodput req/s | TTFT ms p50/p90/p99 "
    "| TPOT ms p50/p90/p99 | ITL ms p50/p90/p99 | E2EL ms p50/p90/p99 |"
)


def load_tables(rounds: list[dict[str, Any]], names: list[str], args: argparse.Namespace) -> list[str]:
    slo = " and ".join(f"{k} <= {v:g} ms" for k, v in args.slo_ms.items())
    lines = [
        f"\n### Fixed concurrency: {args.input_len} tokens in, {args.output_len} out, requests back to back "
        f"(pooled over {len(rounds)} round(s); goodput: {slo})\n",
        "| server | streams " + LOAD_HEADER,
        "|---|--:" + "|--:" * 9 + "|",
    ]
    for name in names:
        for c in args.concurrency:
            run = pooled(rounds, name, lambda r, c=c: r["fixed"][c])
            lines.append(load_row([name, str(c)], summarize(run, args.slo_ms)))
    if args.request_rate:
        lines += [
            f"\n### Poisson arrivals: {args.poisson_requests} requests per rate, same lengths\n",
            "| server | rate/s " + LOAD_HEADER,
            "|---|--:" + "|--:" * 9 + "|",
        ]
        for name in names:
            for rate in args.request_rate:
                run = pooled(rounds, name, lambda r, rate=rate: r["poisson"][rate])
                lines.append(load_row([name, f"{rate:g}"], summarize(run, args.slo_ms)))
    return lines


def prefix_table(rounds: list[dict[str, Any]], names: list[str], args: argparse.Namespace) -> list[str]:
    lines = [
        f"\n### Shared prefix: {args.prefix_len}-token prefix + {args.suffix_len}-token unique suffix, "
        f"{args.prefix_requests} requests at {args.prefix_concurrency} streams, {args.prefix_output_len} "
        "tokens out, prefix warmed by one request first (pooled over rounds)\n",
        "| server | requests | TTFT ms p50 | TTFT ms p90 | TPOT ms p50 | E2EL ms p50 | mean prompt tokens "
        "| mean cached_tokens |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name in names:
        s = summarize(pooled(rounds, name, lambda r: r["prefix"]), args.slo_ms)
        cells = [
            name,
            str(s["completed"]),
            f"{s['ttft_ms']['p50']:.0f}",
            f"{s['ttft_ms']['p90']:.0f}",
            f"{s['tpot_ms']['p50']:.0f}",
            f"{s['e2el_ms']['p50']:.0f}",
            "-" if s["mean_prompt_tokens"] is None else f"{s['mean_prompt_tokens']:.0f}",
            "not reported" if s["mean_cached_tokens"] is None else f"{s['mean_cached_tokens']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tok_s(run: Run, args: argparse.Namespace) -> float:
    return float(summarize(run, args.slo_ms)["output_tokens_per_s"])


def ttft_p50(run: Run, args: argparse.Namespace) -> float:
    return float(summarize(run, args.slo_ms)["ttft_ms"]["p50"] or "nan")


def per_round_ratios(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, list[float]]:
    """Each comparison's ratio in every round that has both sides."""
    ratios: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        ratios.setdefault(key, []).append(value)

    for r in rounds:
        if OURS in r and LLAMA in r:
            ours, theirs = r[OURS], r[LLAMA]
            for c in args.concurrency:
                add(
                    f"{c} streams: output tok/s ours / llama-cpp-python",
                    tok_s(ours["fixed"][c], args) / tok_s(theirs["fixed"][c], args),
                )
            for rate in args.request_rate:
                add(
                    f"Poisson {rate:g}/s: TTFT p50 ours / llama-cpp-python",
                    ttft_p50(ours["poisson"][rate], args) / ttft_p50(theirs["poisson"][rate], args),
                )
            add(
                "shared prefix: TTFT p50 ours / llama-cpp-python",
                ttft_p50(ours["prefix"], args) / ttft_p50(theirs["prefix"], args),
            )
        if OURS in r and "in_process" in r:
            for c in args.concurrency:
                http, local = r[OURS]["fixed"][c], r["in_process"]["fixed"][c]
                add(f"{c} streams: output tok/s HTTP / in-process", tok_s(http, args) / tok_s(local, args))
    return ratios


def verdict(key: str, median: float, top: int) -> str:
    if key == f"{top} streams: output tok/s ours / llama-cpp-python" and top == 16:
        return f"target >= {TARGET_SPEEDUP:g}x: {'PASS' if median >= TARGET_SPEEDUP else 'FAIL'}"
    if key.startswith("shared prefix"):
        return f"target <= {TARGET_PREFIX_TTFT:g}: {'PASS' if median <= TARGET_PREFIX_TTFT else 'FAIL'}"
    if key == f"{top} streams: output tok/s HTTP / in-process" and top == 16:
        ok = 1 - median <= TARGET_HTTP_COST
        return f"target HTTP cost <= {TARGET_HTTP_COST:.0%} (ratio >= 0.95): {'PASS' if ok else 'FAIL'}"
    return ""


def target_lines(ratios: dict[str, list[float]], args: argparse.Namespace) -> list[str]:
    """The issue's three targets, each with its measured median (or why it was not measured)."""
    top = max(args.concurrency)
    keys = [
        f"{top} streams: output tok/s ours / llama-cpp-python",
        "shared prefix: TTFT p50 ours / llama-cpp-python",
        f"{top} streams: output tok/s HTTP / in-process",
    ]
    lines = ["\nTargets (median over rounds):"]
    for key in keys:
        if key not in ratios:
            lines.append(f"- {key}: not measured in this run")
            continue
        median = statistics.median(ratios[key])
        lines.append(f"- {key} = {median:.3f}: {verdict(key, median, top) or 'no target at this level'}")
    return lines


def ratio_table(ratios: dict[str, list[float]], args: argparse.Namespace) -> list[str]:
    lines = [
        "\n### Ratios, each taken within a round (median and range over rounds) and the issue's targets\n",
        "| comparison | per round | median | range | target |",
        "|---|---|--:|---|---|",
    ]
    for key, values in ratios.items():
        median = statistics.median(values)
        cells = [
            key,
            ", ".join(f"{v:.3f}" for v in values),
            f"{median:.3f}",
            f"{min(values):.3f}-{max(values):.3f}",
        ]
        lines.append("| " + " | ".join([*cells, verdict(key, median, max(args.concurrency))]) + " |")
    return lines


def overhead_table(rounds: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = [
        "\n### HTTP overhead: the fixed-concurrency levels through our server and on AsyncLLM in process\n",
        "| round | streams | HTTP output tok/s | in-process output tok/s | HTTP / in-process | HTTP cost "
        "| HTTP TTFT p50 ms | in-process TTFT p50 ms |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for i, r in enumerate(rounds):
        if OURS not in r or "in_process" not in r:
            continue
        for c in args.concurrency:
            http, local = r[OURS]["fixed"][c], r["in_process"]["fixed"][c]
            ratio = tok_s(http, args) / tok_s(local, args)
            lines.append(
                f"| {i + 1} | {c} | {tok_s(http, args):.1f} | {tok_s(local, args):.1f} | {ratio:.3f} "
                f"| {1 - ratio:+.1%} | {ttft_p50(http, args):.0f} | {ttft_p50(local, args):.0f} |"
            )
    return lines


def sanity_lines(rounds: list[dict[str, Any]], names: list[str]) -> list[str]:
    lines = ["\nPrompt-length check (non-streamed request, first round):"]
    for name in names:
        s = rounds[0][name]["sanity"]
        warm: RequestRecord = rounds[0][name]["warmup"]
        lines.append(
            f"- {name}: HTTP {s['status']}, {s['prompt_words']} one-token words -> prompt_tokens "
            f"{s['prompt_tokens']}; asked {s['asked_tokens']} tokens -> completion_tokens "
            f"{s['completion_tokens']} ({s['finish_reason']}); streamed warm-up: {warm.text_chunks} text "
            f"chunks, {warm.output_tokens} tokens counted"
        )
    return lines


def to_json(value: Any, args: argparse.Namespace) -> Any:
    if isinstance(value, Run):
        return value.to_json(args.slo_ms)
    if isinstance(value, RequestRecord):
        return asdict(value)
    if isinstance(value, dict):
        return {str(k): to_json(v, args) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v, args) for v in value]
    return value


def print_report(
    rounds: list[dict[str, Any]], specs: list[ServerSpec], args: argparse.Namespace
) -> dict[str, Any]:
    names = [s.name for s in specs]
    lines = sanity_lines(rounds, names) + load_tables(rounds, names, args) + prefix_table(rounds, names, args)
    if not args.no_in_process and OURS in names:
        lines += overhead_table(rounds, args)
    ratios = per_round_ratios(rounds, args)
    if ratios:
        lines += ratio_table(ratios, args)
    lines += target_lines(ratios, args)
    print("\n".join(lines), flush=True)
    return {
        "args": {
            k: (str(v) if not isinstance(v, (int, float, list, dict, type(None))) else v)
            for k, v in vars(args).items()
        },
        "server_argv": {s.name: s.argv for s in specs},
        "ratios": ratios,
        "rounds": to_json(rounds, args),
    }

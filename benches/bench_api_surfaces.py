"""What each API surface of the server costs: the same streamed, greedy, fixed-length requests through
``/v1/chat/completions``, OpenAI's ``/v1/responses`` and Anthropic's ``/v1/messages`` (in process, over
httpx's ASGI transport, so the figures are the server's own work: translation, parsing, event
formatting), the surfaces alternated in a rotating order over ``--rounds`` rounds. Each request has
``ignore_eos`` and ``min_tokens`` = its length, so each surface streams exactly as many tokens (checked
from each answer's usage). The prompts are warmed once first, so every surface finds them cached.

Per surface and concurrency: output tokens/s over the batch (median over rounds, with its ratio to
chat's in the same round) and the median time to the first event carrying text (the random
model's first tokens may decode to no text, so this is not the time to the first token).

    python benches/bench_api_surfaces.py [--rounds 5] [--threads N] [--model PATH]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

import oxibonsai as ob
from oxibonsai.server.api_server import build_app
from oxibonsai.server.config import ServerConfig

from bench_args import parse

OUTPUT_TOKENS = 48
CONCURRENCY = (1, 8)
WORDS = ["the", "model", "returns", "a", "list", "of", "files", "in", "path", "and", "data", "user"]


def chat_body(prompt: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": OUTPUT_TOKENS,
        "stream_options": {"include_usage": True},
    }


def responses_body(prompt: str) -> dict[str, Any]:
    return {"input": prompt, "max_output_tokens": OUTPUT_TOKENS}


def messages_body(prompt: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": OUTPUT_TOKENS}


def chat_events(data: dict[str, Any]) -> tuple[bool, int | None]:
    """(whether the event carries text, the output tokens it reports)."""
    text = any(c["delta"].get("content") for c in data.get("choices", []))
    usage = data.get("usage")
    return text, usage["completion_tokens"] if usage else None


def responses_events(data: dict[str, Any]) -> tuple[bool, int | None]:
    usage = data.get("response", {}).get("usage") if data["type"].startswith("response.") else None
    return data["type"] == "response.output_text.delta", usage["output_tokens"] if usage else None


def messages_events(data: dict[str, Any]) -> tuple[bool, int | None]:
    tokens = data["usage"]["output_tokens"] if data["type"] == "message_delta" else None
    return data["type"] == "content_block_delta", tokens


SURFACES: dict[str, tuple[str, Callable[[str], dict[str, Any]], Callable[[dict[str, Any]], Any]]] = {
    "chat": ("/v1/chat/completions", chat_body, chat_events),
    "responses": ("/v1/responses", responses_body, responses_events),
    "messages": ("/v1/messages", messages_body, messages_events),
}


async def one(client: httpx.AsyncClient, surface: str, prompt: str) -> float:
    """Streams one request; returns its time to the first text event (checks its token count)."""
    path, body, read = SURFACES[surface]
    fields = {"temperature": 0, "ignore_eos": True, "min_tokens": OUTPUT_TOKENS, "stream": True}
    start, first, tokens = time.perf_counter(), None, None
    async with client.stream("POST", path, json={**body(prompt), **fields}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text, reported = read(json.loads(line[len("data: ") :]))
            if text and first is None:
                first = time.perf_counter() - start
            tokens = reported if reported is not None else tokens
    assert tokens == OUTPUT_TOKENS and first is not None, (surface, tokens)
    return first


async def batch(client: httpx.AsyncClient, surface: str, prompts: list[str]) -> tuple[float, float]:
    """(output tokens/s, median time to first text) of the prompts sent at once."""
    start = time.perf_counter()
    firsts = await asyncio.gather(*(one(client, surface, p) for p in prompts))
    return len(prompts) * OUTPUT_TOKENS / (time.perf_counter() - start), statistics.median(firsts)


async def measure(app: Any, rounds: int) -> dict[tuple[str, int], list[tuple[float, float]]]:
    prompts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(24)) for i in range(max(CONCURRENCY))]
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:
        for surface in SURFACES:  # warm-up: every prompt cached, every path run once
            await batch(client, surface, prompts)
        names = list(SURFACES)
        for r in range(rounds):
            for n in CONCURRENCY:
                for surface in names[r % len(names) :] + names[: r % len(names)]:
                    results.setdefault((surface, n), []).append(await batch(client, surface, prompts[:n]))
    return results


def report(results: dict[tuple[str, int], list[tuple[float, float]]]) -> None:
    print("| concurrency | surface | output tokens/s | vs chat (median, range) | first text p50 ms |")
    print("|--:|---|--:|--:|--:|")
    for n in CONCURRENCY:
        chat = [rate for rate, _ in results[("chat", n)]]
        for surface in SURFACES:
            runs = results[(surface, n)]
            ratios = [rate / c for (rate, _), c in zip(runs, chat, strict=True)]
            rate = statistics.median(r for r, _ in runs)
            ttft = statistics.median(t for _, t in runs) * 1e3
            spread = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            print(f"| {n} | {surface} | {rate:.1f} | {spread} | {ttft:.1f} |")


def main() -> None:
    args = parse(5, model=True)
    engine = ob.AsyncLLM(args.model, max_num_seqs=max(CONCURRENCY))
    try:
        app = build_app(engine, ServerConfig(served_model_name="bench"))
        name = Path(args.model).name if args.model else "the embedded model"
        print(f"model: {name}; threads: {ob.get_num_threads()}; rounds: {args.rounds}")
        report(asyncio.run(measure(app, args.rounds)))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

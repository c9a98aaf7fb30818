"""The client side of ``bench_serve.py``: prompts, streamed requests, workloads and their metrics.

A request is one streamed ``/v1/completions`` call (or one ``AsyncLLM.generate`` in process) recorded
as a ``RequestRecord``: when it was sent, time to the first chunk carrying text (TTFT), the gaps
between text chunks (ITL), the end-to-end latency (E2EL, to the end of the stream) and the output
tokens (the usage's ``completion_tokens`` when the server sends a usage, else the text chunks).
Workloads drive many requests: a fixed number of streams sending back to back, or Poisson arrivals;
``summarize`` turns their records into ``vllm bench serve``'s figures. Nothing here starts a server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

import oxibonsai

# Words that are one token each in the random model's vocabulary (tests/tiny_vocab.py MERGED_WORDS with
# a leading space; the Qwen2 pre-tokenizer splits before each space), so a prompt of n words is n tokens
# for both servers whatever their tokenizer code.
ONE_TOKEN_WORDS = (
    " the", " and", " of", " to", " is", " Hello", " world", " a", " you", " Hi", " assistant",
)  # fmt: skip
PERCENTILES = (50, 90, 99)


def word_prompt(rng: np.random.Generator, n_tokens: int) -> str:
    return "".join(ONE_TOKEN_WORDS[i] for i in rng.integers(0, len(ONE_TOKEN_WORDS), n_tokens))


def word_prompts(seed: int, count: int, n_tokens: int, prefix: str = "") -> list[str]:
    rng = np.random.default_rng(seed)
    return [prefix + word_prompt(rng, n_tokens) for _ in range(count)]


@dataclass
class RequestRecord:
    start_s: float = 0.0  # when it was sent, from the start of the workload
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text_chunks: int = 0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Run:
    """One workload's requests and its wall time (first send to last response)."""

    records: list[RequestRecord]
    duration_s: float

    @classmethod
    def pooled(cls, runs: list[Run]) -> Run:
        """Several runs as one: their requests together over their summed time."""
        return cls([r for run in runs for r in run.records], sum(run.duration_s for run in runs))

    def to_json(self, slo_ms: dict[str, float]) -> dict[str, Any]:
        return {**summarize(self, slo_ms), "requests": [asdict(r) for r in self.records]}


def completion_payload(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Greedy, fixed length: ``ignore_eos`` for servers that know it, ``min_tokens`` (which
    llama-cpp-python honours by masking EOS) for the others; ``repeat_penalty`` 1 turns off
    llama-cpp-python's default 1.1 (our server ignores the unknown field)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "repeat_penalty": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def note_chunk(record: RequestRecord, chunk: dict[str, Any], elapsed: float, last: float | None) -> bool:
    """Folds one SSE chunk into the record; True when it carried text (a token event)."""
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens", record.output_tokens)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens")
    choices = chunk.get("choices") or []
    if not choices:
        return False
    record.finish_reason = choices[0].get("finish_reason") or record.finish_reason
    if not choices[0].get("text"):
        return False
    record.text_chunks += 1
    if record.ttft_s is None:
        record.ttft_s = elapsed
    elif last is not None:
        record.itl_s.append(elapsed - last)
    return True


async def read_stream(response: httpx.Response, record: RequestRecord, sent: float) -> None:
    last = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, ": ping" comments
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            record.error = json.dumps(chunk["error"])[:300]
            break
        elapsed = time.perf_counter() - sent
        if note_chunk(record, chunk, elapsed, last):
            last = elapsed


async def stream_completion(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], t0: float
) -> RequestRecord:
    sent = time.perf_counter()
    record = RequestRecord(start_s=sent - t0)
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
            else:
                await read_stream(response, record, sent)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        record.error = f"{type(error).__name__}: {error}"
    record.e2el_s = time.perf_counter() - sent
    if record.output_tokens == 0:
        record.output_tokens = record.text_chunks
    return record


async def generate_in_process(
    engine: oxibonsai.AsyncLLM, prompt: str, max_tokens: int, t0: float
) -> RequestRecord:
    """The same request without HTTP: each cumulative output that grew is one token event."""
    params = oxibonsai.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sent = time.perf_counter()
    record = RequestRecord(start_s=sent - t0)
    last = None
    async for out in engine.generate(prompt, params):
        completion = out.outputs[0]
        if len(completion.token_ids) > record.output_tokens:
            elapsed = time.perf_counter() - sent
            record.ttft_s = elapsed if record.ttft_s is None else record.ttft_s
            if last is not None:
                record.itl_s.append(elapsed - last)
            last = elapsed
            record.text_chunks += 1
            record.output_tokens = len(completion.token_ids)
        record.finish_reason = completion.finish_reason
    record.prompt_tokens = len(out.prompt_token_ids or [])
    record.e2el_s = time.perf_counter() - sent
    return record


SendOne = Callable[[str, float], Awaitable[RequestRecord]]


async def fixed_concurrency(send: SendOne, prompts: list[str], streams: int) -> Run:
    """`streams` workers take prompts in order, each sending its next as soon as the last finished."""
    queue = list(reversed(prompts))
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def worker() -> None:
        while queue:
            records.append(await send(queue.pop(), t0))

    await asyncio.gather(*(worker() for _ in range(streams)))
    return Run(records, time.perf_counter() - t0)


async def poisson_arrivals(send: SendOne, prompts: list[str], rate: float, seed: int) -> Run:
    """Requests sent at the times of a Poisson process of `rate` per second, whatever is in flight."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
    t0 = time.perf_counter()
    tasks = []
    for prompt, at in zip(prompts, np.cumsum(gaps) - gaps[0], strict=True):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        tasks.append(asyncio.create_task(send(prompt, t0)))
    records = list(await asyncio.gather(*tasks))
    return Run(records, time.perf_counter() - t0)


def quantiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}}


def meets_slo(record: RequestRecord, slo_ms: dict[str, float]) -> bool:
    measured = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.e2el_s}
    return all(measured[k] is not None and 1000 * measured[k] <= v for k, v in slo_ms.items())  # type: ignore[operator]


def summarize(run: Run, slo_ms: dict[str, float]) -> dict[str, Any]:
    """``vllm bench serve``'s figures."""
    records, duration_s = run.records, run.duration_s
    ok = [r for r in records if r.error is None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration_s,
        "requests_per_s": len(ok) / duration_s,
        "goodput_requests_per_s": sum(meets_slo(r, slo_ms) for r in ok) / duration_s,
        "mean_prompt_tokens": float(np.mean(prompt_tokens)) if prompt_tokens else None,
        "mean_cached_tokens": float(np.mean(cached)) if cached else None,
        "ttft_ms": quantiles_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": quantiles_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": quantiles_ms([gap for r in ok for gap in r.itl_s]),
        "e2el_ms": quantiles_ms([r.e2el_s for r in ok if r.e2el_s is not None]),
    }

"""``/metrics`` beyond the engine's own ``oxibonsai_*`` series: the vLLM-named aliases that dashboards,
llm-d's scheduler and vLLM production-stack's router scrape (``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, prefix-cache queries and hits, the latency histograms, ...; every series
labelled ``model_name`` and ``engine`` as vLLM labels them), and per-endpoint HTTP counters and
latency histograms named as prometheus-fastapi-instrumentator names them (``http_requests_total``)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from oxibonsai.metrics import LATENCY_BUCKETS, Histogram

# vLLM histogram name -> our histogram name
_HISTOGRAM_ALIASES = {
    "vllm:time_to_first_token_seconds": "time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds": "time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "queue_time_seconds",
}


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _sample(name: str, labels: str, value: float) -> str:
    return f"{name}{labels} {float(value)!r}"


def vllm_aliases(
    snapshot: dict[str, Any], cache: dict[str, Any], model_name: str, block_size: int, engine: str = "0"
) -> str:
    """The engine's metrics under vLLM's names, from ``AsyncLLM.metrics()`` and ``cache_stats()``
    (``engine``: vLLM's engine label; a replica's id behind Ray Serve)."""
    base = _labels(model_name=model_name, engine=engine)
    capacity = max(1, int(cache["capacity_blocks"]))
    used = capacity - int(cache["free_blocks"]) - int(cache["idle_blocks"])
    counters = snapshot["counters"]
    lines: list[str] = []
    gauges = {
        "vllm:num_requests_running": (snapshot["num_running"], "Requests in the running batch."),
        "vllm:num_requests_waiting": (snapshot["num_waiting"], "Requests waiting to be scheduled."),
        "vllm:kv_cache_usage_perc": (used / capacity, "Fraction of KV blocks in use (1 = full)."),
        "vllm:gpu_cache_usage_perc": (used / capacity, "Deprecated name of vllm:kv_cache_usage_perc."),
    }
    for name, (value, help_text) in gauges.items():
        lines += [*_family(name, "gauge", help_text), _sample(name, base, value)]
    totals = {
        "vllm:prefix_cache_queries_total": (
            cache["queried_tokens"],
            "Prompt tokens looked up in the prefix cache.",
        ),
        "vllm:prefix_cache_hits_total": (cache["hit_tokens"], "Prompt tokens found in the prefix cache."),
        "vllm:gpu_prefix_cache_queries_total": (cache["queried_tokens"], "Old name of prefix_cache_queries."),
        "vllm:gpu_prefix_cache_hits_total": (cache["hit_tokens"], "Old name of prefix_cache_hits."),
        "vllm:prompt_tokens_total": (counters["prompt_tokens_total"], "Prompt tokens computed."),
        "vllm:generation_tokens_total": (counters["generation_tokens_total"], "Tokens generated."),
        "vllm:num_preemptions_total": (counters["preemptions_total"], "Preemptions."),
    }
    for name, (value, help_text) in totals.items():
        lines += [*_family(name, "counter", help_text), _sample(name, base, value)]
    lines += _family("vllm:request_success_total", "counter", "Finished requests by finish reason.")
    for reason, count in counters["requests_finished"].items():
        labels = _labels(model_name=model_name, engine=engine, finished_reason=reason)
        lines.append(_sample("vllm:request_success_total", labels, count))
    for alias, ours in _HISTOGRAM_ALIASES.items():
        lines += _histogram(alias, snapshot["histograms"][ours], model_name, engine)
    info = _labels(
        model_name=model_name,
        engine=engine,
        block_size=str(block_size),
        num_gpu_blocks=str(capacity),
        enable_prefix_caching=str(bool(cache.get("enabled", True))),
    )
    lines += [
        *_family("vllm:cache_config_info", "gauge", "KV cache configuration."),
        _sample("vllm:cache_config_info", info, 1),
    ]
    return "\n".join(lines) + "\n"


def _histogram(name: str, h: dict[str, Any], model_name: str, engine: str) -> list[str]:
    lines = _family(name, "histogram", f"Alias of the oxibonsai histogram for {name}.")
    for le, count in h["buckets"].items():
        lines.append(_sample(f"{name}_bucket", _labels(model_name=model_name, engine=engine, le=le), count))
    base = _labels(model_name=model_name, engine=engine)
    lines += [_sample(f"{name}_sum", base, h["sum"]), _sample(f"{name}_count", base, h["count"])]
    return lines


class HttpMetrics:
    """Requests per (handler, method, status class) and their latency per (handler, method)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str, str]] = Counter()
        self._latency: dict[tuple[str, str], Histogram] = {}

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        with self._lock:
            self._counts[(handler, method, f"{status // 100}xx")] += 1
            key = (handler, method)
            if key not in self._latency:
                self._latency[key] = Histogram(LATENCY_BUCKETS)
            self._latency[key].observe(seconds)

    def count(self, handler: str, method: str, status_class: str) -> int:
        with self._lock:
            return self._counts[(handler, method, status_class)]

    def to_prometheus(self) -> str:
        with self._lock:
            lines = _family("http_requests_total", "counter", "HTTP requests by handler, method and status.")
            for (handler, method, status), n in sorted(self._counts.items()):
                lines.append(
                    _sample("http_requests_total", _labels(handler=handler, method=method, status=status), n)
                )
            lines += _family("http_request_duration_seconds", "histogram", "HTTP request latency.")
            for (handler, method), h in sorted(self._latency.items()):
                for le, n in h.cumulative():
                    labels = _labels(handler=handler, method=method, le=le)
                    lines.append(_sample("http_request_duration_seconds_bucket", labels, n))
                labels = _labels(handler=handler, method=method)
                lines.append(_sample("http_request_duration_seconds_sum", labels, h.sum))
                lines.append(_sample("http_request_duration_seconds_count", labels, h.count))
        return "\n".join(lines) + "\n"

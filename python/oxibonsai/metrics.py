"""Engine metrics: latency histograms per finished request, counters and gauges per engine, readable
as a plain dict (``snapshot``) or as Prometheus' text exposition format (``to_prometheus``).

``EngineMetrics`` owns only the numbers. The engine decides when to report: it calls
``on_request_finished`` once per request that leaves it, ``on_step`` once per step and ``set_gauges``
whenever its state changes. Every method takes one lock, so the step loop may record while another
thread (an HTTP ``/metrics`` handler, ``AsyncLLM.metrics``) reads. Histograms follow Prometheus:
cumulative bucket counts, a sum and a count; the bounds are vLLM's with finer low bounds, since a
1-bit model on a CPU often answers in milliseconds. Aborted requests are counted but kept out of the
latency histograms, whose tails they would distort."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from typing import Any

from oxibonsai.outputs import RequestMetrics

#: Bucket upper bounds, in seconds (``+Inf`` is implied).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
QUANTILES = (0.5, 0.9, 0.99)

# name -> (help text, buckets, the RequestMetrics property observed)
_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...], str]] = {
    "queue_time_seconds": ("From arrival to first scheduling.", LATENCY_BUCKETS, "queue_time"),
    "time_to_first_token_seconds": (
        "From arrival to the first generated token.",
        LATENCY_BUCKETS,
        "time_to_first_token",
    ),
    "time_per_output_token_seconds": (
        "Mean time between generated tokens after the first, per request.",
        TOKEN_LATENCY_BUCKETS,
        "time_per_output_token",
    ),
    "e2e_request_latency_seconds": ("From arrival to the last token.", LATENCY_BUCKETS, "e2e_latency"),
}
_COUNTERS = {
    "prompt_tokens_total": "Prompt tokens computed (prefix-cache hits excluded).",
    "generation_tokens_total": "Tokens generated.",
    "preemptions_total": "Requests preempted to free KV blocks.",
    "spec_decode_num_drafts_total": "Decodes that carried drafted tokens (speculative decoding).",
    "spec_decode_num_draft_tokens_total": "Tokens drafted.",
    "spec_decode_num_accepted_tokens_total": "Drafted tokens accepted.",
}
_PER_POSITION_HELP = "Drafted tokens accepted, by their position in the draft (0: the first)."
_FINISHED_HELP = "Requests that left the engine, by finish reason."
_FINISH_REASONS = ("stop", "length", "abort")
#: Gauges present from the start; ``set_gauges`` may add others.
GAUGES = ("num_requests_running", "num_requests_waiting", "prefix_cache_hit_rate", "kv_blocks_used")
_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class Histogram:
    """Prometheus-style: per-bucket counts (cumulated when read), a sum and a count."""

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError("histogram bounds must be non-empty, increasing and distinct")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last is the +Inf bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self._counts[i] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le label, observations <= le)`` for every bound, then ``("+Inf", count)``."""
        out, total = [], 0
        for bound, n in zip([*self.bounds, math.inf], self._counts, strict=True):
            total += n
            out.append((_le(bound), total))
        return out

    def quantile(self, q: float) -> float | None:
        """An estimate, interpolating linearly inside the bucket that holds rank ``q * count`` (as
        Prometheus' ``histogram_quantile``); the highest finite bound when it falls in ``+Inf``."""
        if self.count == 0:
            return None
        rank, below, lower = q * self.count, 0, 0.0
        for bound, n in zip(self.bounds, self._counts, strict=False):
            if n and below + n >= rank:
                return lower + (bound - lower) * (rank - below) / n
            below, lower = below + n, bound
        return self.bounds[-1]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"buckets": dict(self.cumulative()), "sum": self.sum, "count": self.count}
        for q in QUANTILES:
            out[f"p{round(q * 100)}"] = self.quantile(q)
        return out


class EngineMetrics:
    """Thread-safe counters, gauges and latency histograms of one engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._histograms = {name: Histogram(spec[1]) for name, spec in _HISTOGRAMS.items()}
        self._finished: dict[str, int] = dict.fromkeys(_FINISH_REASONS, 0)
        self._counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._gauges: dict[str, float] = dict.fromkeys(GAUGES, 0.0)
        self._accepted_at: dict[int, int] = {}  # accepted drafts by position

    def on_request_finished(self, m: RequestMetrics, finish_reason: str) -> None:
        """Counts a request that left the engine; observes its latencies unless it was aborted."""
        with self._lock:
            self._finished[finish_reason] = self._finished.get(finish_reason, 0) + 1
            if finish_reason == "abort":
                return
            for name, (_, _, attr) in _HISTOGRAMS.items():
                value = getattr(m, attr)
                if value is not None:
                    self._histograms[name].observe(max(0.0, value))

    def on_step(self, num_prompt_tokens: int, num_generation_tokens: int, num_preemptions: int) -> None:
        """Adds one step's computed prompt tokens, generated tokens and preemptions."""
        if min(num_prompt_tokens, num_generation_tokens, num_preemptions) < 0:
            raise ValueError("step counts must be >= 0")
        with self._lock:
            self._counters["prompt_tokens_total"] += num_prompt_tokens
            self._counters["generation_tokens_total"] += num_generation_tokens
            self._counters["preemptions_total"] += num_preemptions

    def on_drafts(self, drafts: Sequence[tuple[int, int]]) -> None:
        """Adds one step's speculative decodes: ``(drafted, accepted)`` tokens of each decode that
        carried drafts (a draft is accepted only after those before it)."""
        if any(not 0 <= a <= d for d, a in drafts):
            raise ValueError("each decode accepts between 0 and its drafted tokens")
        with self._lock:
            self._counters["spec_decode_num_drafts_total"] += len(drafts)
            self._counters["spec_decode_num_draft_tokens_total"] += sum(d for d, _ in drafts)
            self._counters["spec_decode_num_accepted_tokens_total"] += sum(a for _, a in drafts)
            for _, a in drafts:
                for position in range(a):
                    self._accepted_at[position] = self._accepted_at.get(position, 0) + 1

    def set_gauges(self, **values: float) -> None:
        """Sets gauges by name (``num_requests_running``, ``num_requests_waiting``,
        ``prefix_cache_hit_rate``, ``kv_blocks_used``, or any other metric name)."""
        for name, value in values.items():
            if not _NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid metric name")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"gauge {name} must be a number, got {type(value).__name__}")
        with self._lock:
            self._gauges.update({k: float(v) for k, v in values.items()})

    def snapshot(self) -> dict[str, Any]:
        """A plain, JSON-able copy: ``counters`` (``requests_finished`` by reason, the token and
        preemption totals, and speculative decoding's: drafts, drafted and accepted tokens, accepted
        by position), ``gauges`` and ``histograms`` (``buckets`` as ``{le: cumulative count}``,
        ``sum``, ``count``, ``p50``/``p90``/``p99`` estimates or None when empty)."""
        with self._lock:
            return {
                "counters": {
                    "requests_finished": dict(self._finished),
                    **self._counters,
                    "spec_decode_num_accepted_tokens_per_pos": dict(sorted(self._accepted_at.items())),
                },
                "gauges": dict(self._gauges),
                "histograms": {name: h.to_dict() for name, h in self._histograms.items()},
            }

    def to_prometheus(self, prefix: str = "oxibonsai") -> str:
        """The Prometheus text exposition format (version 0.0.4), every name under ``prefix_``."""
        if not _NAME.fullmatch(prefix):
            raise ValueError(f"{prefix!r} is not a valid metric name prefix")
        with self._lock:
            lines = _family(f"{prefix}_requests_finished_total", "counter", _FINISHED_HELP)
            lines += [
                f'{prefix}_requests_finished_total{{finished_reason="{r}"}} {n}'
                for r, n in self._finished.items()
            ]
            for name, count in self._counters.items():
                lines += _family(f"{prefix}_{name}", "counter", _COUNTERS[name])
                lines.append(f"{prefix}_{name} {count}")
            per_pos = f"{prefix}_spec_decode_num_accepted_tokens_per_pos_total"
            lines += _family(per_pos, "counter", _PER_POSITION_HELP)
            lines += [f'{per_pos}{{position="{p}"}} {n}' for p, n in sorted(self._accepted_at.items())]
            for name, value in self._gauges.items():
                lines += _family(f"{prefix}_{name}", "gauge", f"Engine gauge {name}.")
                lines.append(f"{prefix}_{name} {_number(value)}")
            for name, h in self._histograms.items():
                lines += _histogram_lines(f"{prefix}_{name}", _HISTOGRAMS[name][0], h)
        return "\n".join(lines) + "\n"


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _histogram_lines(name: str, help_text: str, h: Histogram) -> list[str]:
    lines = _family(name, "histogram", help_text)
    lines += [f'{name}_bucket{{le="{le}"}} {n}' for le, n in h.cumulative()]
    lines += [f"{name}_sum {_number(h.sum)}", f"{name}_count {h.count}"]
    return lines


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else _number(bound)


def _number(value: float) -> str:
    return repr(float(value))

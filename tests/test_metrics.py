"""``EngineMetrics`` and the derived ``RequestMetrics`` timings, on synthetic requests: histogram
counts, sums and quantile estimates, counters by reason, gauges, and the Prometheus text format."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai.metrics import LATENCY_BUCKETS, EngineMetrics, Histogram


def synthetic(rng: np.random.Generator, generated: int | None = None) -> ob.RequestMetrics:
    """A finished request with random, ordered timestamps."""
    arrival = float(rng.uniform(0, 100))
    scheduled = arrival + float(rng.exponential(0.05))
    first = scheduled + float(rng.exponential(0.02))
    n = int(rng.integers(2, 50)) if generated is None else generated
    finished = first + (n - 1) * float(rng.exponential(0.01))
    return ob.RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=first,
        finished_time=finished,
        num_prompt_tokens=int(rng.integers(1, 100)),
        num_generated_tokens=n,
    )


def test_request_metrics_derived_timings(rng):
    m = synthetic(rng)
    assert m.queue_time == pytest.approx(m.first_scheduled_time - m.arrival_time)
    tpot = (m.finished_time - m.first_token_time) / (m.num_generated_tokens - 1)
    assert m.time_per_output_token == pytest.approx(tpot)
    assert m.time_per_output_token == pytest.approx(1 / m.decode_tokens_per_s)
    one = synthetic(rng, generated=1)
    assert one.time_per_output_token is None and one.queue_time is not None
    waiting = ob.RequestMetrics(arrival_time=1.0)
    assert waiting.queue_time is None and waiting.time_per_output_token is None


def test_histograms_count_and_sum_finished_requests(rng):
    metrics = EngineMetrics()
    finished = [synthetic(rng) for _ in range(int(rng.integers(5, 40)))]
    for m in finished:
        metrics.on_request_finished(m, str(rng.choice(["stop", "length"])))
    h = metrics.snapshot()["histograms"]
    for name, attr in [
        ("queue_time_seconds", "queue_time"),
        ("time_to_first_token_seconds", "time_to_first_token"),
        ("time_per_output_token_seconds", "time_per_output_token"),
        ("e2e_request_latency_seconds", "e2e_latency"),
    ]:
        values = [getattr(m, attr) for m in finished]
        assert h[name]["count"] == len(values)
        assert h[name]["sum"] == pytest.approx(sum(values))
        buckets = h[name]["buckets"]
        assert buckets["+Inf"] == len(values)
        for le, n in buckets.items():
            if le != "+Inf":
                assert n == sum(v <= float(le) for v in values)


def test_aborted_requests_are_counted_but_not_timed(rng):
    metrics = EngineMetrics()
    metrics.on_request_finished(synthetic(rng), "stop")
    metrics.on_request_finished(synthetic(rng), "length")
    metrics.on_request_finished(synthetic(rng), "length")
    metrics.on_request_finished(ob.RequestMetrics(arrival_time=0.0), "abort")
    snap = metrics.snapshot()
    assert snap["counters"]["requests_finished"] == {"stop": 1, "length": 2, "abort": 1}
    assert all(h["count"] == 3 for h in snap["histograms"].values())


def test_a_request_without_tokens_is_timed_where_it_can_be():
    metrics = EngineMetrics()
    metrics.on_request_finished(ob.RequestMetrics(arrival_time=1.0, finished_time=1.5), "stop")
    h = metrics.snapshot()["histograms"]
    assert h["e2e_request_latency_seconds"]["count"] == 1
    assert h["time_to_first_token_seconds"]["count"] == 0
    assert h["time_to_first_token_seconds"]["p50"] is None


def test_quantiles_interpolate_within_buckets(rng):
    h = Histogram([1.0, 2.0, 4.0])
    for v in [0.5] * 50 + [1.5] * 40 + [3.0] * 10:
        h.observe(v)
    assert h.quantile(0.5) == pytest.approx(1.0)
    assert h.quantile(0.9) == pytest.approx(2.0)
    assert h.quantile(0.25) == pytest.approx(0.5)
    assert h.quantile(0.7) == pytest.approx(1.5)
    assert h.quantile(0.99) == pytest.approx(2.0 + 2.0 * 0.9)
    h.observe(100.0)
    assert h.quantile(1.0) == 4.0  # in the +Inf bucket: the highest finite bound
    values = rng.exponential(0.2, size=2000)
    big = Histogram(LATENCY_BUCKETS)
    for v in values:
        big.observe(float(v))
    p50, p90 = big.quantile(0.5), big.quantile(0.9)
    lower = max((b for b in LATENCY_BUCKETS if b < np.quantile(values, 0.5)), default=0.0)
    upper = min(b for b in LATENCY_BUCKETS if b >= np.quantile(values, 0.5))
    assert lower <= p50 <= upper and p50 < p90


def test_histogram_rejects_unordered_bounds():
    with pytest.raises(ValueError):
        Histogram([1.0, 0.5])
    with pytest.raises(ValueError):
        Histogram([])


def test_step_counters_and_gauges(rng):
    metrics = EngineMetrics()
    steps = rng.integers(0, 100, size=(20, 3))
    for p, g, pre in steps:
        metrics.on_step(int(p), int(g), int(pre))
    metrics.set_gauges(num_requests_running=3, num_requests_waiting=7, prefix_cache_hit_rate=0.25)
    metrics.set_gauges(kv_blocks_used=12, kv_blocks_total=64)
    snap = metrics.snapshot()
    c = snap["counters"]
    assert c["prompt_tokens_total"] == int(steps[:, 0].sum())
    assert c["generation_tokens_total"] == int(steps[:, 1].sum())
    assert c["preemptions_total"] == int(steps[:, 2].sum())
    assert snap["gauges"] == {
        "num_requests_running": 3.0,
        "num_requests_waiting": 7.0,
        "prefix_cache_hit_rate": 0.25,
        "kv_blocks_used": 12.0,
        "kv_blocks_total": 64.0,
    }
    with pytest.raises(ValueError):
        metrics.on_step(-1, 0, 0)
    with pytest.raises(ValueError):
        metrics.set_gauges(**{"bad name": 1})
    with pytest.raises(TypeError):
        metrics.set_gauges(num_requests_running="3")


def test_snapshot_is_plain_json_and_a_copy(rng):
    metrics = EngineMetrics()
    metrics.on_request_finished(synthetic(rng), "stop")
    snap = metrics.snapshot()
    assert json.loads(json.dumps(snap, allow_nan=False)) == snap
    snap["counters"]["requests_finished"]["stop"] = 99
    assert metrics.snapshot()["counters"]["requests_finished"]["stop"] == 1


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"\})? (\S+)$')


def test_prometheus_text_format(rng):
    metrics = EngineMetrics()
    for _ in range(5):
        metrics.on_request_finished(synthetic(rng), "length")
    metrics.on_step(10, 5, 1)
    metrics.set_gauges(num_requests_running=2)
    text = metrics.to_prometheus("ob")
    assert text.endswith("\n")
    families, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families[name] = kind
        elif not line.startswith("# HELP "):
            m = _SAMPLE.match(line)
            assert m, line
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    assert families["ob_time_to_first_token_seconds"] == "histogram"
    assert families["ob_preemptions_total"] == "counter"
    assert families["ob_num_requests_running"] == "gauge"
    assert samples['ob_requests_finished_total{finished_reason="length"}'] == 5
    assert samples["ob_prompt_tokens_total"] == 10 and samples["ob_preemptions_total"] == 1
    assert samples["ob_num_requests_running"] == 2
    assert samples['ob_e2e_request_latency_seconds_bucket{le="+Inf"}'] == 5
    assert samples["ob_e2e_request_latency_seconds_count"] == 5
    buckets = [v for k, v in samples.items() if k.startswith("ob_queue_time_seconds_bucket")]
    assert buckets == sorted(buckets) and len(buckets) == len(LATENCY_BUCKETS) + 1
    with pytest.raises(ValueError):
        metrics.to_prometheus("bad prefix")


def test_recording_from_many_threads_loses_nothing(rng):
    metrics = EngineMetrics()
    per_thread = [[synthetic(rng) for _ in range(200)] for _ in range(4)]

    def record(batch: list[ob.RequestMetrics]) -> None:
        for m in batch:
            metrics.on_request_finished(m, "stop")
            metrics.on_step(1, 1, 0)
            metrics.snapshot()

    threads = [threading.Thread(target=record, args=(b,)) for b in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = metrics.snapshot()
    assert snap["counters"]["requests_finished"]["stop"] == 800
    assert snap["counters"]["generation_tokens_total"] == 800
    assert snap["histograms"]["e2e_request_latency_seconds"]["count"] == 800

"""Small fixed costs that decisions in README rest on, each timed here in one run:

1. ``abi3``: token-id conversion on our fast path (an exact ``list``: CPython macros outside the limited
   API) against PyO3's generic sequence path, which is what an abi3 build would take (the same call
   with a ``list`` subclass), through ``PrefixCache.match``, for 16, 1,024 and 8,192 ids.
2. ``seam``: the torch runner's per-step cost outside the model for an 8-sequence decode step:
   ``schedule``, ``prepare`` (the plan's numpy arrays), ``StepBatch`` + ``to_device("cpu")``, ``update``.
3. ``engine``: the host's time in one ``Engine.step`` of the torch runner in plain decode at 1, 16 and
   64 running requests, the model's forward pass stubbed out (what a GPU's step time adds to).
4. ``overlap``: the same engine over a simulated device (draws ready a fixed time after the launch):
   step time with each step's output work after its tokens against overlapping the next step.
5. ``ahead``: the same over a simulated in-order device queue: step time with each step planned
   after the last one's tokens against launched ahead of them (``async_scheduling``).
6. ``router``: the prefix router's index: bytes per indexed block key, hashing a prompt into block
   keys, and walking 100 replicas' indexes for a 64-block prompt (every block hit / first block missed).

    python benches/overheads.py [--sections abi3 seam engine overlap ahead router]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import timeit
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from oxibonsai import _core


def best_us(call: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e6


class _List(list):
    pass


def abi3() -> None:
    cache = _core.PrefixCache(4)
    print("| ids | exact list (us) | generic path (us) | generic / exact |\n|--:|--:|--:|--:|")
    for n in (16, 1024, 8192):
        ids = [random.randrange(151_936) for _ in range(n)]
        sub = _List(ids)
        number = max(1, 200_000 // n)
        fast = best_us(lambda ids=ids: cache.match(ids), number)
        generic = best_us(lambda sub=sub: cache.match(sub), number)
        print(f"| {n} | {fast:.2f} | {generic:.2f} | {generic / fast:.2f} |")


def seam(steps: int = 2000) -> None:
    import torch  # noqa: F401  (imported before timing: its first import is seconds)

    from oxibonsai.torch_backend.batch import StepBatch

    sched = _core.Scheduler(512, enable_prefix_caching=True, max_num_seqs=8, max_num_batched_tokens=2048)
    for i in range(8):
        sched.add(i, list(range(i * 1000, i * 1000 + 200)))
    out = sched.schedule()
    sched.prepare(out)
    sched.update(out, [1] * out.num_sample)
    totals = dict.fromkeys(("schedule", "prepare", "tensors", "update"), 0.0)
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        plan = sched.prepare(out)
        t2 = time.perf_counter()
        StepBatch.from_plan(plan).to_device("cpu")
        t3 = time.perf_counter()
        sched.update(out, [1] * out.num_sample)
        t4 = time.perf_counter()
        for key, dt in zip(totals, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            totals[key] += dt
    print("8-sequence decode step, us: " + ", ".join(f"{k} {v / steps * 1e6:.1f}" for k, v in totals.items()))


def engine(steps: int = 300) -> None:
    """Host time of one ``Engine.step`` of the torch runner in plain decode, the model's forward pass
    replaced by fixed logits (so only the host's work is timed: scheduling, the plan, the graph buffer,
    greedy sampling on the logits, each request's detokenizing and stop checks), at 1, 16 and 64
    running requests. The steps go through ``DecodeGraphs`` eagerly (``capture=False``), so each also
    builds the bucket's input views, which a CUDA replay skips (about 20 us here). A GPU's own step
    time adds to this unless the output work overlaps it (see ``overlap``)."""
    llm = _stubbed_llm()
    eng, runner = llm._engine, llm._engine._runner
    print("| running requests | engine step (us) | runner launch + draws (us) | the rest (us) |")
    print("|--:|--:|--:|--:|")
    spent = _time_runner(runner)
    for batch in (1, 16, 64):
        _start_decoding(eng, batch)
        spent[0] = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            eng.step()
        total = (time.perf_counter() - start) / steps * 1e6
        inside = spent[0] / steps * 1e6
        print(f"| {batch} | {total:.0f} | {inside:.0f} | {total - inside:.0f} |")
        eng.abort_all()


def overlap(steps: int = 200, rounds: int = 3) -> None:
    """Wall time of an ``Engine.step`` over a simulated device: the stubbed engine of ``engine``, whose
    draws are ready only ``device_us`` after the launch (the host spins until then, as a CUDA event
    wait does), with the output work after the step's tokens (``async_output`` off) and overlapping the
    next step (on), rounds interleaved. With the overlap a step should take about the device's time
    plus the host's work up to the launch, without it that plus every request's output work."""
    llm = _stubbed_llm()
    eng, runner = llm._engine, llm._engine._runner
    launch = runner.launch
    device_s = [0.0]
    runner.launch = lambda *a: _Ready(launch(*a), time.perf_counter() + device_s[0])
    print("| running requests | simulated device step (us) | step, output after (us) "
          "| step, overlapped (us) | after / overlapped |\n|--:|--:|--:|--:|--:|")  # fmt: skip
    _interleaved(eng, runner, "async_output", (16, 64), device_s, steps, rounds)


def ahead(steps: int = 200, rounds: int = 5) -> None:
    """Wall time of an ``Engine.step`` over a simulated in-order device (each launch's draws are ready
    ``device_us`` after both the launch returned and the device finished the steps queued before it;
    the host spins until then, as a CUDA event wait does), with each step planned after the last one's
    tokens against launched ahead of them (``async_scheduling``), rounds interleaved; the output work
    overlaps the next step in both (``async_output``, as on CUDA). Ahead, a step should take about the
    device's time alone whenever the host's work fits inside it."""
    llm = _stubbed_llm()
    eng, runner = llm._engine, llm._engine._runner
    launch = runner.launch
    device_s, free_at = [0.0], [0.0]

    def queued_launch(sched: Any, out: Any, rows: Any, feed: Any = None) -> _Ready:
        if feed is not None:  # the runner reads the device ids of its own draws
            feed = type(feed)(feed.draws.pending, feed.rows)
        pending = launch(sched, out, rows, feed)
        free_at[0] = max(time.perf_counter(), free_at[0]) + device_s[0]  # queued once launch returns
        return _Ready(pending, free_at[0])

    runner.launch = queued_launch
    runner.async_output = True
    print("| running requests | simulated device step (us) | step, planned after the tokens (us) "
          "| step, launched ahead (us) | after / ahead |\n|--:|--:|--:|--:|--:|")  # fmt: skip
    _interleaved(eng, runner, "async_scheduling", (1, 16, 64), device_s, steps, rounds)
    runner.async_output = False


class _Ready:
    """A launch's draws, ready at ``ready`` (``perf_counter`` seconds): ``draws`` spins until then."""

    def __init__(self, pending: Any, ready: float) -> None:
        self.pending, self.ready = pending, ready

    def draws(self) -> Any:
        while time.perf_counter() < self.ready:
            pass
        return self.pending.draws()


def _interleaved(
    eng: Any, runner: Any, switch: str, batches: tuple[int, ...], device_s: list[float], steps: int,
    rounds: int,
) -> None:  # fmt: skip
    """Prints a row per batch size and simulated device step: the best step time with the runner's
    ``switch`` off and on, rounds interleaved; leaves it off."""
    for batch in batches:
        for device_us in (500, 1000, 2000):
            device_s[0] = device_us * 1e-6
            best = {False: float("inf"), True: float("inf")}
            for _ in range(rounds):
                for on in (False, True):
                    setattr(runner, switch, on)
                    _start_decoding(eng, batch)
                    start = time.perf_counter()
                    for _ in range(steps):
                        eng.step()
                    best[on] = min(best[on], (time.perf_counter() - start) / steps * 1e6)
                    eng.abort_all()
            print(f"| {batch} | {device_us} | {best[False]:.0f} | {best[True]:.0f} | "
                  f"{best[False] / best[True]:.2f} |")  # fmt: skip
    setattr(runner, switch, False)


def _stubbed_llm() -> Any:
    """An ``LLM`` on the torch runner on the CPU, with device sampling and eager ``DecodeGraphs`` (as on
    a GPU, less the capture), whose model returns fixed logits: only the host's work remains."""
    import tempfile
    from pathlib import Path

    import torch

    import oxibonsai as ob
    from oxibonsai.torch_backend.graphs import DecodeGraphs
    from oxibonsai.torch_backend.model import TorchQwen3

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from models import write_tiny

    path = write_tiny(Path(tempfile.mkdtemp()) / "tiny.gguf", 1)
    llm = ob.LLM(path, device="cpu", runner="torch", max_model_len=512, max_num_seqs=64)
    runner = llm._engine._runner
    runner.sample_on_device = True  # as on a GPU: greedy draws from the logits tensor
    runner.graphs = DecodeGraphs(runner.model, runner.kv, max_num_seqs=64, max_model_len=512, capture=False)
    logits = torch.randn(64, llm.config["vocab"])
    TorchQwen3.forward = lambda self, batch, kv: logits[: batch.logits_indices.shape[0]]  # type: ignore[method-assign]
    return llm


def _start_decoding(eng: Any, batch: int) -> None:
    """``batch`` requests of 19-token prompts, long enough for any run, past their prefill."""
    import oxibonsai as ob

    params = ob.SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"{batch}-{time.perf_counter_ns()}-{i}", None, list(range(1, 20)), params)
    for _ in range(5):
        eng.step()  # the prompts, then decodes


def _time_runner(runner: Any) -> list[float]:
    """Adds the seconds spent in the runner's ``launch`` and its draws to the returned cell."""
    launch, spent = runner.launch, [0.0]

    class Timed:
        def __init__(self, pending: Any) -> None:
            self.pending = pending

        def draws(self) -> Any:
            t = time.perf_counter()
            result = self.pending.draws()
            spent[0] += time.perf_counter() - t
            return result

    def timed_launch(*args: object) -> Timed:
        t = time.perf_counter()
        result = launch(*args)
        spent[0] += time.perf_counter() - t
        return Timed(result)

    runner.launch = timed_launch
    return spent


def router() -> None:
    blocks = 100_000
    keys = _core.block_hashes([random.randrange(151_936) for _ in range(16 * blocks)])
    tracemalloc.start()
    index: OrderedDict[int, None] = OrderedDict((k, None) for k in keys)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    prompt = [random.randrange(151_936) for _ in range(16 * 64)]
    hashing = best_us(lambda: _core.block_hashes(prompt), 200) / 64
    prompt_keys = _core.block_hashes(prompt)

    def walk(idx: OrderedDict[int, None]) -> None:
        for _ in range(100):
            for key in prompt_keys:
                if key not in idx:
                    break

    misses = best_us(lambda: walk(index), 20)
    index.update((k, None) for k in prompt_keys)
    hits = best_us(lambda: walk(index), 20)
    print(
        f"index: {used / len(keys):.0f} bytes per key; hashing {hashing * 1e3:.0f} ns per 16-token block; "
        f"100 replicas x 64 blocks: {hits / 1e3:.2f} ms all hit, {misses / 1e3:.2f} ms first block missed"
    )


SECTIONS = {
    "abi3": abi3,
    "seam": seam,
    "engine": engine,
    "overlap": overlap,
    "ahead": ahead,
    "router": router,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args()
    random.seed(0)
    for name in args.sections:
        print(f"## {name}")
        SECTIONS[name]()


if __name__ == "__main__":
    main()

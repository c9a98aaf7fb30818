"""Steps launched ahead (``TorchRunner.async_scheduling``, the default on CUDA; forced on the CPU here):
the engine launches the next step of decodes before the current step's tokens are read, and the runner
feeds it those tokens on the device. Every request's outputs (streamed snapshots: text, tokens, finish
and stop reasons, logprobs) equal those of steps planned one at a time, for mixes of greedy, seeded,
stop-string, stop-token, ``min_tokens``, logprob and penalty requests (the penalties counting the
token in flight), through the decode graphs' buffers and eagerly; steps are in fact launched ahead; a
request aborted while a step runs ahead gets no more output, and a failed step drops the step ahead;
no KV block leaks, and the scheduler's invariants hold after every step."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from request_mix import mixed_requests, summary  # noqa: E402

import oxibonsai as ob  # noqa: E402
from oxibonsai.torch_backend.graphs import DecodeGraphs  # noqa: E402
from oxibonsai.torch_backend.model import TorchQwen3  # noqa: E402


def torch_llm(
    path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator, graphs: bool, **kwargs: Any
) -> ob.LLM:
    """The torch runner on the CPU sampling on its device, as on a GPU, with a row-wise model (see
    ``rowwise_forward``); with ``graphs``, decode steps go through ``DecodeGraphs``' padded buffers, run
    eagerly."""
    monkeypatch.setenv("OXIBONSAI_DEVICE_SAMPLING", "1")
    args = {"device": "cpu", "runner": "torch", "max_model_len": 256, "max_num_seqs": 4,
            "max_num_batched_tokens": 24, **kwargs}  # fmt: skip
    llm = ob.LLM(path, **args)
    runner = llm._engine._runner
    assert not runner.async_scheduling, "off by default off CUDA"
    seed = int(rng.integers(2**31))  # from the printed rng seed, so a failure replays
    monkeypatch.setattr(TorchQwen3, "forward", rowwise_forward(llm.config["vocab"], 256, seed))
    if graphs:
        runner.graphs = DecodeGraphs(
            runner.model, runner.kv, max_num_seqs=4, max_model_len=256, capture=False
        )
    return llm


def rowwise_forward(vocab: int, positions: int, seed: int) -> Callable[..., torch.Tensor]:
    """A forward pass whose logits row is a fixed random function of its token and position alone: a
    row gets the same bits in any batch (the torch kernels' rows do not, and a step ahead can hold a
    row more than a step planned after the tokens: a request that just ended), and a step's rows
    depend on the ids it was fed."""
    gen = torch.Generator().manual_seed(seed)
    by_token = torch.randn(vocab, vocab, generator=gen) * 4
    by_position = torch.randn(positions, vocab, generator=gen)

    def forward(self: TorchQwen3, batch: Any, kv: Any) -> torch.Tensor:
        rows = batch.logits_indices.long()
        return by_token[batch.input_ids.long()[rows]] + by_position[batch.positions.long()[rows]]

    return forward


class Counting:
    """The engine's runner, counting the steps launched with a ``Feed`` (ahead)."""

    def __init__(self, runner: Any) -> None:
        self._runner, self.ahead, self.steps = runner, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def launch(self, sched: Any, out: Any, rows: Any, feed: Any = None) -> Any:
        self.steps += 1
        self.ahead += feed is not None
        return self._runner.launch(sched, out, rows, feed)


def run(
    llm: ob.LLM, requests: list[tuple[list[int], ob.SamplingParams]], ahead: bool
) -> tuple[Any, Counting]:
    """Every streamed output of each request, checking the scheduler after every step."""
    engine = llm._engine
    runner = Counting(engine._runner)
    runner.async_scheduling = ahead
    runner.async_output = ahead
    engine._runner = runner
    tag = "ahead" if ahead else "plain"
    generated = llm.metrics()["counters"]["generation_tokens_total"]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", None, prompt, params, stream=True)
    seen: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                seen[int(out.request_id.split("-")[1])].append(summary(out))
            engine._sched.check()
    finally:
        engine._runner = runner._runner
    stats = llm.cache_stats()
    llm.reset_prefix_cache()
    assert llm.cache_stats()["free_blocks"] == stats["capacity_blocks"], "a KV block leaked"
    generated = llm.metrics()["counters"]["generation_tokens_total"] - generated
    assert generated == sum(len(outputs[-1][2]) for outputs in seen.values()), "dropped tokens counted"
    return dict(seen), runner


@pytest.mark.parametrize("graphs", [True, False], ids=["graph-buffers", "eager"])
def test_steps_launched_ahead_change_no_output(tiny_model, monkeypatch, rng, graphs):
    llm = torch_llm(tiny_model, monkeypatch, rng, graphs)
    requests = mixed_requests(llm, rng)
    plain, plain_runner = run(llm, requests, ahead=False)
    ahead, ahead_runner = run(llm, requests, ahead=True)
    assert ahead == plain
    # Only while no request is in prefill and none waits for a free slot.
    assert plain_runner.ahead == 0 and ahead_runner.ahead > 0


def test_greedy_decodes_go_ahead_every_step_and_give_the_tokens_of_each_alone(tiny_model, monkeypatch, rng):
    llm = torch_llm(
        tiny_model, monkeypatch, rng, graphs=True, enable_prefix_caching=True, max_num_batched_tokens=256
    )
    vocab = llm.config["vocab"]
    prompts = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(3, 40)))] for _ in range(4)]
    lengths = [int(n) for n in rng.integers(1, 40, 4)]
    alone = [
        llm.generate(p, ob.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        for p, n in zip(prompts, lengths, strict=True)
    ]
    requests = [(p, ob.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for p, n in zip(prompts, lengths, strict=True)]  # fmt: skip
    ahead, runner = run(llm, requests, ahead=True)
    assert [ahead[i][-1] for i in range(4)] == [summary(o) for o in alone]
    # Every step after the prompts' one goes ahead but, at worst, one after each request that ends by
    # its length.
    assert runner.ahead >= max(lengths) - 1 - len(lengths)


def test_a_request_aborted_while_a_step_runs_ahead_gets_no_more_output(tiny_model, monkeypatch, rng):
    llm = torch_llm(tiny_model, monkeypatch, rng, graphs=True, enable_prefix_caching=False)
    engine = llm._engine
    params = ob.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = [[int(t) for t in rng.integers(0, 300, int(rng.integers(2, 30)))] for _ in range(4)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine._runner.async_scheduling = True
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, p, params, stream=True)
    victim = str(int(rng.integers(0, 4)))
    outputs: dict[str, list[ob.RequestOutput]] = defaultdict(list)
    steps = int(rng.integers(1, 8))
    while (steps > 0 or engine._launched is None) and engine.has_unfinished():  # then one ahead
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps -= 1
    assert engine._launched is not None and engine._launched[0].step == engine._sched.stats()["steps"]
    assert engine.abort(victim)
    seen_before_abort = len(outputs[victim])
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
        engine._sched.check()
    assert len(outputs[victim]) == seen_before_abort
    for rid in map(str, range(4)):
        if rid != victim:
            assert outputs[rid][-1].outputs[0].token_ids == alone[int(rid)]
    stats = llm.cache_stats()
    assert stats["free_blocks"] == stats["capacity_blocks"]


def test_a_step_ahead_bans_stop_ids_up_to_min_tokens_counting_the_token_in_flight(
    tiny_model, monkeypatch, rng
):
    """A request alone (every decode goes ahead) with ``min_tokens`` m whose stop id is the token it
    draws at index m: banned before, so it ends exactly there, as when planned after each token."""
    llm = torch_llm(tiny_model, monkeypatch, rng, graphs=True)
    prompt = [int(t) for t in rng.integers(0, llm.config["vocab"], 9)]
    free = llm.generate(prompt, ob.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    drawn = free[0].outputs[0].token_ids
    m = next(i for i in range(3, 30) if drawn[i] not in drawn[:i])
    params = ob.SamplingParams(max_tokens=40, temperature=0.0, min_tokens=m, stop_token_ids=[drawn[m]])
    plain, _ = run(llm, [(prompt, params)], ahead=False)
    ahead, runner = run(llm, [(prompt, params)], ahead=True)
    assert plain[0][-1][2] == tuple(drawn[: m + 1]) and plain[0][-1][3] == "stop"
    assert ahead == plain and runner.ahead >= m - 2
    # Its stop token came with a step ahead in flight, which the next call takes first.
    assert llm._engine._launched is not None
    again, _ = run(llm, [(prompt, params)], ahead=True)
    assert again == ahead and llm._engine._launched is not None


def test_a_failed_step_drops_the_step_launched_ahead_and_the_engine_goes_on(tiny_model, monkeypatch, rng):
    """NaN logits at one position fail ``generate`` (the sampler's error) while a step runs ahead of
    them; every block comes back, and the next request gets the tokens it gets on a fresh engine."""
    llm = torch_llm(tiny_model, monkeypatch, rng, graphs=True, enable_prefix_caching=False)
    prompt = [int(t) for t in rng.integers(0, llm.config["vocab"], 5)]
    params = ob.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = llm.generate(prompt, params)[0].outputs[0].token_ids
    rowwise = TorchQwen3.forward
    bad = len(prompt) + int(rng.integers(2, 8))

    def failing(self: TorchQwen3, batch: Any, kv: Any) -> torch.Tensor:
        logits = rowwise(self, batch, kv)
        at = batch.positions.long()[batch.logits_indices.long()] == bad
        return logits.masked_fill(at[:, None], float("nan"))

    llm._engine._runner.async_scheduling = True
    monkeypatch.setattr(TorchQwen3, "forward", failing)
    with pytest.raises(ValueError, match="NaN"):
        llm.generate([prompt, prompt[::-1]], params)
    monkeypatch.setattr(TorchQwen3, "forward", rowwise)
    stats = llm.cache_stats()
    assert stats["free_blocks"] == stats["capacity_blocks"] and not llm._engine.has_unfinished()
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
    llm._engine._sched.check()


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 4.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}],
    ids=["repetition", "presence", "frequency"],
)
def test_a_step_ahead_penalizes_the_token_in_flight(tiny_model, monkeypatch, rng, penalty):
    """A model that repeats its last token unless a penalty counts it (its logit 1 + u, the others'
    u, u uniform in [0, 0.5)): a request alone goes ahead every step, and its penalties count the
    token the step before sampled, which only the device knows then, as when planned after it."""
    llm = torch_llm(tiny_model, monkeypatch, rng, graphs=True)
    vocab = llm.config["vocab"]
    base = torch.rand(256, vocab, generator=torch.Generator().manual_seed(int(rng.integers(2**31)))) / 2

    def repeating(self: TorchQwen3, batch: Any, kv: Any) -> torch.Tensor:
        rows = batch.logits_indices.long()
        logits = base[batch.positions.long()[rows]].clone()
        logits[torch.arange(rows.shape[0]), batch.input_ids.long()[rows]] += 1.0
        return logits

    monkeypatch.setattr(TorchQwen3, "forward", repeating)
    prompt = [int(t) for t in rng.integers(0, vocab, 6)]
    params = ob.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **penalty)
    plain, _ = run(llm, [(prompt, params)], ahead=False)
    ahead, runner = run(llm, [(prompt, params)], ahead=True)
    tokens = plain[0][-1][2]
    assert all(a != b for a, b in pairwise(tokens)), "the penalty stops the repeats"
    assert ahead == plain and runner.ahead >= len(tokens) - 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the asynchronous device path needs CUDA")
def test_on_cuda_steps_launched_ahead_give_the_outputs_of_steps_planned_after(tiny_model, monkeypatch, rng):
    """The real thing: CUDA graphs replayed behind the step in flight and fed its sampled ids on the
    device, over the exact Q1 kernels (a row's bits do not depend on its batch): the request mix's
    outputs equal those of steps planned after their tokens, and steps did go ahead."""
    for switch in ("OXIBONSAI_ASYNC_SCHEDULING", "OXIBONSAI_DEVICE_SAMPLING", "OXIBONSAI_TORCH_OPS"):
        monkeypatch.delenv(switch, raising=False)
    llm = ob.LLM(tiny_model, device="cuda", runner="torch", max_model_len=256, max_num_seqs=4,
                 max_num_batched_tokens=24)  # fmt: skip
    assert llm._engine._runner.async_scheduling, "on by default on CUDA"
    requests = mixed_requests(llm, rng)
    plain, _ = run(llm, requests, ahead=False)
    ahead, runner = run(llm, requests, ahead=True)
    assert ahead == plain and runner.ahead > 0
    assert llm._engine._runner.graphs.replays > 0

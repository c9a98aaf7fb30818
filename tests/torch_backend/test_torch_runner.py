"""``LLM(..., runner="torch")`` end to end on the CPU device (plain-torch ops): the same greedy tokens as
the float64 reference and as the exact native runner; batched vs alone, cached vs uncached and
preempted vs not give identical tokens; a device pool a few blocks large with a host tier demotes and
promotes (or prefetches, for a waiting request) instead of recomputing, changes no token and leaks no
block; impossible devices and sizes
fail at construction with clear errors."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

import oxibonsai as ob  # noqa: E402
from oxibonsai import runner as runner_mod  # noqa: E402

from qwen3_reference import ReferenceQwen3  # noqa: E402

GREEDY = ob.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def random_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def token_lists(outs: list[ob.RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def torch_llm(path: Path, **kwargs: object) -> ob.LLM:
    args: dict[str, object] = {"device": "cpu", "runner": "torch", "max_model_len": 256, "max_num_seqs": 4}
    return ob.LLM(path, **{**args, **kwargs})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def torch_uncached(tiny_model: Path) -> ob.LLM:
    return torch_llm(tiny_model, enable_prefix_caching=False, kv_cache_dtype="f32")


def test_greedy_tokens_match_the_float64_reference_and_the_exact_native_runner(
    tiny_model, torch_uncached, rng
):
    vocab = torch_uncached.config["vocab"]
    prompts = [random_ids(rng, vocab, int(rng.integers(1, 40))) for _ in range(3)]
    ours = token_lists(torch_uncached.generate(prompts, GREEDY))
    reference = ReferenceQwen3.from_gguf(tiny_model)
    assert ours == [reference.greedy(p, GREEDY.max_tokens) for p in prompts]
    native = ob.LLM(tiny_model, kernel="reference", kv_cache_dtype="f32", max_model_len=256)
    assert ours == token_lists(native.generate(prompts, GREEDY))
    assert torch_uncached.runner == "torch" and torch_uncached.device == "cpu"


def test_logits_match_the_float64_reference(tiny_untied_model, rng):
    llm = torch_llm(tiny_untied_model, kv_cache_dtype="f32")
    ids = random_ids(rng, llm.config["vocab"], 21)
    ours = llm.logits(ids)
    want = ReferenceQwen3.from_gguf(tiny_untied_model).logits64(ids)
    rel = np.linalg.norm(ours - want, axis=1) / np.linalg.norm(want, axis=1)
    assert ours.shape == want.shape and ours.dtype == np.float32
    assert float(np.median(rel)) < 1e-5
    assert llm.cache_stats()["computed_tokens"] == 0, "logits() runs outside the cache"
    for bad in (-1, llm.config["vocab"]):
        with pytest.raises(ValueError, match="out of range for a vocabulary"):
            llm.logits([*ids[:3], bad])


def test_batched_cached_and_preempted_runs_give_the_tokens_of_lone_uncached_runs(
    tiny_model, torch_uncached, rng
):
    vocab = torch_uncached.config["vocab"]
    prefix = random_ids(rng, vocab, 24)
    prompts = [prefix + random_ids(rng, vocab, 8) for _ in range(4)]  # 2 blocks each
    params = ob.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)  # growing to 4 blocks
    alone = [token_lists(torch_uncached.generate(p, params))[0] for p in prompts]
    cached = torch_llm(tiny_model, kv_cache_dtype="f32")
    assert token_lists(cached.generate(prompts, params)) == alone
    assert token_lists(cached.generate(prompts, params)) == alone
    assert cached.cache_stats()["hit_tokens"] > 0
    # Six blocks: three requests start, then their decodes run out of blocks and preempt.
    tight = torch_llm(tiny_model, kv_cache_dtype="f32", kv_cache_blocks=6, enable_prefix_caching=False)
    assert token_lists(tight.generate(prompts, params)) == alone
    assert tight.metrics()["scheduler"]["preemptions"] > 0


def test_a_tiny_device_pool_demotes_and_promotes_instead_of_recomputing(tiny_model, torch_uncached, rng):
    vocab = torch_uncached.config["vocab"]
    prompts = [random_ids(rng, vocab, int(rng.integers(33, 70))) for _ in range(4)]
    prompts += [p[: int(rng.integers(33, len(p) + 1))] + random_ids(rng, vocab, 3) for p in prompts]
    blocks = max(-(-(len(p) + GREEDY.max_tokens) // 16) for p in prompts) + 1
    llm = torch_llm(tiny_model, kv_cache_dtype="f32", kv_cache_blocks=blocks, host_kv_cache_blocks=64)
    order = prompts + prompts[::-1]
    got = [token_lists(llm.generate(p, GREEDY))[0] for p in order]
    assert got == token_lists(torch_uncached.generate(order, GREEDY))
    stats = llm.cache_stats()
    assert stats["demotions"] > 0 and stats["promotions"] > 0, stats
    assert stats["host_hit_tokens"] > 0 and stats["bytes_promoted"] == stats["promotions"] * (
        stats["capacity_bytes"] // blocks
    )
    assert stats["free_blocks"] + stats["idle_blocks"] == blocks, "a device block leaked"
    assert stats["host_cached_blocks"] + stats["host_free_blocks"] == 64, "a host block leaked"
    assert llm._engine._sched.check() is None


@pytest.mark.parametrize("prefetch", ["1", "0"])
def test_a_waiting_requests_host_prefix_is_prefetched_and_changes_no_token(
    tiny_model, torch_uncached, rng, monkeypatch, prefetch
):
    monkeypatch.setenv("OXIBONSAI_HOST_PREFETCH", prefetch)
    vocab = torch_uncached.config["vocab"]
    a = random_ids(rng, vocab, 49)  # three full blocks cached, then demoted by the next prompt
    filler = random_ids(rng, vocab, 155)  # with its tokens, all ten device blocks
    c = random_ids(rng, vocab, 40)  # takes the whole token budget while A waits
    llm = torch_llm(
        tiny_model,
        kv_cache_dtype="f32",
        kv_cache_blocks=10,
        host_kv_cache_blocks=32,
        max_num_seqs=2,
        max_num_batched_tokens=16,
    )
    llm.generate(a, GREEDY)
    llm.generate(filler, GREEDY)
    assert llm.cache_stats()["demotions"] >= 3
    got = token_lists(llm.generate([c, a], GREEDY))
    assert got == token_lists(torch_uncached.generate([c, a], GREEDY))
    stats = llm.cache_stats()
    on = prefetch == "1"
    assert stats["prefetched_blocks"] == (3 if on else 0), stats
    assert stats["host_hit_tokens"] == (0 if on else 48), "A found its prefix on the device, or promoted it"
    assert stats["free_blocks"] + stats["idle_blocks"] == 10, "a device block leaked"
    assert llm._engine._sched.check() is None


@pytest.mark.parametrize("prefetch", ["1", "0"])
def test_a_request_arriving_beside_decodes_starts_on_its_prefetched_prefix(
    tiny_model, torch_uncached, rng, monkeypatch, prefetch
):
    """With the prefetch, a request whose prefix sits in the host tier starts a step later, its blocks
    copied beside the decoding request's step; either way every token is the lone uncached run's."""
    monkeypatch.setenv("OXIBONSAI_HOST_PREFETCH", prefetch)
    vocab = torch_uncached.config["vocab"]
    a, decoder = random_ids(rng, vocab, 49), random_ids(rng, vocab, 8)
    llm = torch_llm(tiny_model, kv_cache_dtype="f32", kv_cache_blocks=10, host_kv_cache_blocks=32)
    llm.generate(a, GREEDY)
    llm.generate(random_ids(rng, vocab, 155), GREEDY)  # pushes A's three blocks to the host tier
    engine = llm._engine
    decode = ob.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("decoder", None, decoder, decode)
    engine.step()
    engine.step()
    engine.add_request("a", None, a, GREEDY)
    arrival = engine._requests[engine._handles["a"]]
    finished, steps_to_start = {}, None
    for step in range(1, 40):
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        if steps_to_start is None and arrival.output_ids:
            steps_to_start = step
        if not engine.has_unfinished():
            break
    assert finished["a"] == token_lists(torch_uncached.generate(a, GREEDY))[0]
    assert finished["decoder"] == token_lists(torch_uncached.generate(decoder, decode))[0]
    stats = llm.cache_stats()
    on = prefetch == "1"
    assert stats["prefetched_blocks"] == (3 if on else 0), stats
    assert steps_to_start == (2 if on else 1), "with the prefetch A starts a step later"
    assert stats["free_blocks"] + stats["idle_blocks"] == 10, "a device block leaked"


def test_aborting_the_last_request_settles_a_step_in_flight_with_its_prefetches(tiny_model, rng, monkeypatch):
    """With the output work overlapping the next step (``OXIBONSAI_ASYNC_OUTPUT=1``), a step is in
    flight between two calls; aborting the last request takes it at once, so the blocks its prefetch
    copies hold until they complete come back then, not at a next step that may never come."""
    monkeypatch.setenv("OXIBONSAI_ASYNC_OUTPUT", "1")
    llm = torch_llm(tiny_model, kv_cache_dtype="f32", kv_cache_blocks=10, host_kv_cache_blocks=32)
    vocab = llm.config["vocab"]
    a = random_ids(rng, vocab, 49)
    llm.generate(a, GREEDY)
    llm.generate(random_ids(rng, vocab, 155), GREEDY)  # pushes A's three blocks to the host tier
    engine = llm._engine
    decode = ob.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("decoder", None, random_ids(rng, vocab, 8), decode)
    engine.step()
    engine.add_request("a", None, a, GREEDY)
    engine.step()  # launches the step that prefetches A's prefix beside the decoder
    assert engine._launched is not None and llm.cache_stats()["prefetched_blocks"] == 3
    engine.abort_all()
    stats = llm.cache_stats()
    assert engine._launched is None
    assert stats["free_blocks"] + stats["idle_blocks"] == 10, "a block stayed held"
    assert engine._sched.check() is None


def test_async_llm_streams_on_the_torch_runner(tiny_model, torch_uncached, rng):
    import asyncio

    prompt = random_ids(rng, torch_uncached.config["vocab"], 9)
    want = token_lists(torch_uncached.generate(prompt, GREEDY))[0]

    async def run() -> list[int]:
        engine = ob.AsyncLLM(
            tiny_model, device="cpu", runner="torch", max_model_len=256, kv_cache_dtype="f32"
        )
        try:
            last = None
            async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY, request_id="r"):
                last = out
            assert last is not None and last.finished
            return last.outputs[0].token_ids
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == want


@pytest.mark.parametrize(
    ("device", "runner", "error", "words"),
    [
        ("cpu", "gpu", ValueError, "runner must be one of"),
        ("tpu", "auto", ValueError, "device must be"),
        ("cuda:x", "auto", ValueError, "device must be"),
        ("mps:0", "torch", ValueError, "device must be"),
        ("mps", "native", None, None),
    ],
)
def test_impossible_choices_fail_before_any_work(tiny_model, device, runner, error, words):
    if error is None:
        with pytest.raises(ValueError, match="MPS|native runner"):
            ob.LLM(tiny_model, device=device, runner=runner)
        return
    with pytest.raises(error, match=words):
        ob.LLM(tiny_model, device=device, runner=runner)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_names_the_way_out(tiny_model):
    with pytest.raises(ValueError, match="CUDA is not available.*device='cpu'"):
        ob.LLM(tiny_model, device="cuda")


def test_a_missing_torch_is_named_with_the_extra_to_install(tiny_model, monkeypatch):
    monkeypatch.setattr(runner_mod, "torch_installed", lambda: False)
    with pytest.raises(ImportError, match=r"oxibonsai\[torch\]"):
        ob.LLM(tiny_model, device="cpu", runner="torch")
    assert runner_mod.choose("auto", "auto") == runner_mod.Placement("cpu", "native")


def test_sizes_that_cannot_fit_are_refused_at_load_with_the_sizes(tiny_model):
    from oxibonsai.torch_backend.runner import _DeviceBudget

    with pytest.raises(ValueError, match="at least one block"):
        torch_llm(tiny_model, kv_cache_blocks=0)
    gpu = _DeviceBudget(torch.device("cuda:0"), free=10_000)
    with pytest.raises(ValueError, match="cannot hold the model's weights: 20000 bytes, with 10000"):
        gpu.check_weights(20_000)
    gpu.weights_loaded(6_000)
    with pytest.raises(ValueError, match=r"cannot hold 5 KV blocks \(5000 bytes; one sequence .* needs 2\)"):
        gpu.device_blocks(5, None, 1_000, 32, 4)
    assert gpu.device_blocks(None, None, 1_000, 32, 4) == 4, "the default pool takes what is left"


def test_a_failing_kernel_reports_engine_dead_to_every_waiter(tiny_model, monkeypatch, rng):
    import asyncio

    from oxibonsai.torch_backend.model import TorchQwen3

    def broken(self, batch, kv):  # what a CUDA fault in a kernel or a copy looks like from Python
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def run() -> list[BaseException]:
        engine = ob.AsyncLLM(tiny_model, device="cpu", runner="torch", max_model_len=256)
        monkeypatch.setattr(TorchQwen3, "forward", broken)
        try:

            async def one(i: int) -> None:
                async for _ in engine.generate(
                    {"prompt_token_ids": random_ids(rng, 300, 5)}, GREEDY, request_id=f"r{i}"
                ):
                    pass

            results = await asyncio.gather(*(one(i) for i in range(3)), return_exceptions=True)
            return [r for r in results if isinstance(r, BaseException)]
        finally:
            engine.shutdown()

    errors = asyncio.run(run())
    assert len(errors) == 3 and all(isinstance(e, ob.EngineDeadError) for e in errors), errors


def test_the_plan_carries_its_longest_query_so_kernels_need_no_device_sync():
    from oxibonsai.torch_backend.batch import StepBatch

    mixed = StepBatch.for_sequences(
        [([0], 3, [1], "last"), ([1], 0, [1, 2, 3, 4, 5], "last"), ([2], 0, [7], True)]
    )
    decode = StepBatch.for_sequences([([0], 3, [1], "last"), ([1], 8, [2], "last")])
    assert (mixed.max_query_len, decode.max_query_len) == (5, 1)
    assert mixed.to_device("cpu").max_query_len == 5


def test_each_matmul_is_one_fused_op_with_its_norm_swiglu_and_residual(tiny_model, rng):
    from types import SimpleNamespace

    from oxibonsai.torch_backend.batch import StepBatch
    from oxibonsai.torch_backend.model import TorchQwen3
    from oxibonsai.torch_backend.ops import ref_torch
    from oxibonsai.torch_backend.ops.dispatch import OP_NAMES

    calls = []

    def counting(x, w, *, norm=None, eps=0.0, residual=None, gated=False):
        calls.append((w.rows, norm is not None, residual is not None, gated))
        return ref_torch.q1_fused_linear(x, w, norm=norm, eps=eps, residual=residual, gated=gated)

    ops = SimpleNamespace(**{name: getattr(ref_torch, name) for name in OP_NAMES})
    ops.q1_fused_linear = counting
    ops.attention_linear = functools.partial(
        ref_torch.composed_attention_linear, ref_torch.paged_attention, counting
    )
    model = TorchQwen3.from_gguf(tiny_model, "cpu", ops=ops)
    c, layer = model.config, model.weights.layers[0]
    assert layer.wqkv is not None and layer.wqkv.rows == c.q_dim + 2 * c.kv_dim
    assert layer.wk.signs.untyped_storage().data_ptr() == layer.wqkv.signs.untyped_storage().data_ptr()
    batch = StepBatch.for_sequences([([0, 1], 0, random_ids(rng, c.vocab, 20), "last")])
    model.forward(batch.to_device("cpu"), model.new_kv_pool(2))
    per_layer = [
        (c.q_dim + 2 * c.kv_dim, True, False, False),  # attn_norm -> QKV
        (c.hidden, False, True, False),  # wo + residual
        (2 * c.ffn, True, False, True),  # ffn_norm -> gate|up -> SwiGLU
        (c.hidden, False, True, False),  # down + residual
    ]
    assert calls == per_layer * c.n_layers + [(c.vocab, True, False, False)]


def test_an_int8_kv_cache_is_refused_as_the_native_runners(tiny_model):
    with pytest.raises(ValueError, match="'int8' is the native runner's"):
        torch_llm(tiny_model, kv_cache_dtype="int8")

"""``SamplingParams.logits_processors``: a processor that adds a bias gives the tokens ``logit_bias``
gives (seeded sampling, batched with plain requests that stay unchanged), both call forms see the
request's ids as they grow, in-place edits and returned arrays both count, the logprobs are the
processed logits', and a processor that raises ends its own request only (``LLM.generate`` raises it,
an ``AsyncLLM`` stream raises it while another stream goes on; no block is kept); bad processors and a
runner that samples on the device are clear errors."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import oxibonsai as ob

from server_support import blocks_held


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, 800, n)]


def sampled(rng: np.random.Generator, **more: Any) -> ob.SamplingParams:
    seed = int(rng.integers(2**32))
    return ob.SamplingParams(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True, **more)


def test_a_bias_processor_gives_logit_bias_tokens(tiny_model, rng):
    llm = ob.LLM(tiny_model)
    bias = {int(t): float(rng.uniform(-8, 8)) for t in rng.integers(0, 800, 40)}
    ids, amounts = np.array(list(bias)), np.array(list(bias.values()), dtype=np.float32)

    def add_bias(output_ids: list[int], logits: np.ndarray) -> np.ndarray:
        logits[ids] += amounts
        return logits

    prompts = [random_ids(rng, int(n)) for n in rng.integers(3, 30, 4)]
    base = [sampled(rng) for _ in prompts]
    with_bias = [ob.SamplingParams(**{**vars(p), "logit_bias": bias}) for p in base]
    processed = [ob.SamplingParams(**{**vars(p), "logits_processors": [add_bias]}) for p in base]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, with_bias)]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, base)]
    mixed = llm.generate(prompts + prompts, processed + base)  # batched beside plain requests
    assert [o.outputs[0].token_ids for o in mixed[: len(prompts)]] == want
    assert [o.outputs[0].token_ids for o in mixed[len(prompts) :]] == plain


def test_processors_see_the_ids_and_may_edit_in_place(tiny_model, rng):
    llm = ob.LLM(tiny_model)
    prompt = random_ids(rng, 9)
    forced = int(rng.integers(0, 800))
    seen: list[tuple[list[int], list[int]]] = []

    def record(prompt_ids: list[int], output_ids: list[int], logits: np.ndarray) -> None:
        seen.append((prompt_ids, output_ids))

    def force(output_ids: list[int], logits: np.ndarray) -> None:
        logits[:] = -np.inf
        logits[forced] = 0.0

    out = llm.generate([prompt], sampled(rng, logits_processors=[record, force], logprobs=1))[0].outputs[0]
    assert out.token_ids == [forced] * 12
    assert all(entry[forced].logprob == 0.0 for entry in out.logprobs or []), "the processed logits'"
    assert seen == [(prompt, [forced] * i) for i in range(12)]


def test_a_raising_processor_ends_only_its_request(tiny_model, rng):
    llm = ob.LLM(tiny_model)
    prompts = [random_ids(rng, 7), random_ids(rng, 11)]

    def fails_at_three(output_ids: list[int], logits: np.ndarray) -> np.ndarray:
        if len(output_ids) == 3:
            raise RuntimeError("processor broke")
        return logits

    with pytest.raises(RuntimeError, match="processor broke"):
        llm.generate(prompts, [sampled(rng, logits_processors=[fails_at_three]), sampled(rng)])
    assert (
        not llm._engine.has_unfinished()
        and llm.cache_stats()["free_blocks"] + llm.cache_stats()["idle_blocks"]
        == llm.cache_stats()["capacity_blocks"]
    )
    other = sampled(rng)
    want = llm.generate([prompts[1]], other)[0].outputs[0].token_ids

    engine = ob.AsyncLLM(tiny_model)

    async def go() -> tuple[BaseException | None, list[int]]:
        async def failing() -> BaseException | None:
            try:
                async for _ in engine.generate(prompts[0], sampled(rng, logits_processors=[fails_at_three])):
                    pass
            except RuntimeError as error:
                return error
            return None

        async def plain() -> list[int]:
            outs = [out async for out in engine.generate(prompts[1], other)]
            return outs[-1].outputs[0].token_ids

        return await asyncio.gather(failing(), plain())

    try:
        error, tokens = asyncio.run(go())
        assert isinstance(error, RuntimeError) and tokens == want
        assert engine.is_running and blocks_held(engine) == 0
    finally:
        engine.shutdown()


def test_bad_processors_are_clear_errors(tiny_model, monkeypatch):
    with pytest.raises(TypeError, match=r"logits_processors\[0\] must be callable"):
        ob.SamplingParams(logits_processors=[3])
    with pytest.raises(TypeError, match="must take"):
        ob.SamplingParams(logits_processors=[lambda logits: logits])
    with pytest.raises(TypeError, match="a list of callables"):
        ob.SamplingParams(logits_processors=lambda ids, logits: logits)
    pytest.importorskip("torch")
    monkeypatch.setenv("OXIBONSAI_DEVICE_SAMPLING", "1")
    llm = ob.LLM(tiny_model, runner="torch", device="cpu")
    with pytest.raises(ValueError, match="logits_processors run on the host"):
        llm.generate([[1, 2, 3]], ob.SamplingParams(logits_processors=[lambda ids, logits: logits]))

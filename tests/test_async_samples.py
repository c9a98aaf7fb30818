"""``AsyncLLM.generate`` with ``n > 1`` (``SampleGroupStream``) on the embedded default model: every
streamed output holds ``n`` indexed completions, the last one all finished and equal to
``LLM.generate``'s ``n`` samples; the later samples start from the first one's cached prompt; leaving
early or a failed later submission aborts everything and frees every KV block. Also
``get_tokenizer``, vLLM's accessor, on ``AsyncLLM`` and ``LLM``."""

from __future__ import annotations

import asyncio
import random

import pytest

import oxibonsai as ob
from oxibonsai import QueueFull
from oxibonsai.async_samples import SampleGroupStream

from server_support import engine_idle, wait_until

PROMPT_WORDS = ["the", "module", "returns", "a", "list", "of", "files", "in", "path", "data"]


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(40))  # a few full blocks to cache


async def collect(stream: object) -> list[ob.RequestOutput]:
    return [out async for out in stream]  # type: ignore[attr-defined]


async def generate_all(engine: ob.AsyncLLM, text: str, params: ob.SamplingParams) -> list[ob.RequestOutput]:
    return await collect(engine.generate(text, params, request_id="group"))


def test_n_samples_stream_as_one_output_equal_to_llm_generate(default_engine):
    rng = random.Random()
    text, seed, n = prompt(rng), rng.randrange(2**32), rng.randint(2, 4)
    params = ob.SamplingParams(n=n, max_tokens=12, temperature=1.0, seed=seed)
    before = default_engine.cache_stats()["hit_tokens"]
    outs = asyncio.run(generate_all(default_engine, text, params))
    assert all(len(o.outputs) == n and [c.index for c in o.outputs] == list(range(n)) for o in outs)
    assert all(o.request_id == "group" for o in outs) and outs[-1].finished
    assert not any(o.finished for o in outs[:-1])
    assert outs[0].outputs[1].token_ids == [], "the later samples wait for the first one's prompt"
    want = ob.LLM(None).generate([text], params)[0]
    got = [(c.text, c.token_ids, c.finish_reason) for c in outs[-1].outputs]
    assert got == [(c.text, c.token_ids, c.finish_reason) for c in want.outputs]
    assert default_engine.cache_stats()["hit_tokens"] - before >= (n - 1) * 32, "later samples hit the cache"
    assert wait_until(lambda: engine_idle(default_engine))


def test_leaving_early_aborts_every_sample(default_engine):
    async def two_items() -> None:
        stream = default_engine.generate(
            prompt(random.Random()), ob.SamplingParams(n=3, max_tokens=200, ignore_eos=True)
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()

    asyncio.run(two_items())
    assert wait_until(lambda: engine_idle(default_engine)), "no request or block is left"


def test_a_later_sample_that_cannot_be_submitted_ends_the_group(default_engine):
    params = ob.SamplingParams(n=2, max_tokens=50, ignore_eos=True)

    async def run_group() -> None:
        def submit(i: int) -> object:
            if i > 0:
                raise QueueFull("the queue is full")
            return default_engine.generate(prompt(random.Random()), params.for_sample(0))

        group = SampleGroupStream(submit, params, submit(0), "g")
        with pytest.raises(QueueFull):
            await collect(group)
        assert group.done

    asyncio.run(run_group())
    assert wait_until(lambda: engine_idle(default_engine)), "sample 0 was aborted"


def test_get_tokenizer_by_vllms_name(default_engine):
    tokenizer = asyncio.run(default_engine.get_tokenizer())
    assert tokenizer is default_engine.tokenizer
    llm = ob.LLM(None)
    assert llm.get_tokenizer() is llm.tokenizer

"""``AsyncLLM.beam_search``: the beams are those of ``LLM.beam_search``'s engine form (one-token
requests), also while other requests run beside them; a cancelled search and a full queue leave
nothing running and no block held; a prompt whose beams outgrow the context is refused first."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai.beam_search import EngineBeams, beam_search

from server_support import blocks_held, engine_idle, run, slow_steps, wait_until


def random_prompts(rng: np.random.Generator, k: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, 800, int(n))] for n in rng.integers(3, 40, k)]


def engine_form(
    llm: ob.LLM, prompts: list[list[int]], params: ob.BeamSearchParams
) -> list[ob.BeamSearchOutput]:
    def step(beams: list[list[int]], one: ob.SamplingParams) -> list[ob.RequestOutput]:
        return llm.generate([{"prompt_token_ids": p} for p in beams], one, use_tqdm=False)

    stop = set(llm.tokenizer.stop_token_ids)
    return beam_search(
        lambda: EngineBeams(step, params.beam_width), prompts, params, stop, llm.tokenizer.decode
    )


def summary(outputs: list[ob.BeamSearchOutput]) -> list[list[tuple]]:
    return [[(b.tokens, b.cum_logprob, b.text, b.finish_reason) for b in out.sequences] for out in outputs]


def test_the_beams_are_the_engine_forms_while_other_requests_run(tiny_model, rng):
    prompts = random_prompts(rng, 2)
    params = ob.BeamSearchParams(
        beam_width=int(rng.integers(2, 5)),
        max_tokens=int(rng.integers(3, 10)),
        length_penalty=float(rng.uniform(0, 2)),
    )
    want = engine_form(ob.LLM(tiny_model), prompts, params)
    other = [int(t) for t in rng.integers(0, 800, 30)]

    async def go() -> tuple[list[ob.BeamSearchOutput], ob.RequestOutput]:
        async with ob.AsyncLLM(tiny_model) as engine:

            async def plain() -> ob.RequestOutput:
                last = None
                async for out in engine.generate(
                    {"prompt_token_ids": other}, ob.SamplingParams(max_tokens=40)
                ):
                    last = out
                return last

            got, side = await asyncio.gather(engine.beam_search(prompts, params), plain())
            assert wait_until(lambda: engine_idle(engine))
            return got, side

    got, side = run(go())
    assert summary(got) == summary(want)
    assert side.finished and len(side.outputs[0].token_ids) > 0


def test_a_cancelled_search_leaves_nothing_running(tiny_model, rng):
    (prompt,) = random_prompts(rng, 1)

    async def go() -> None:
        async with ob.AsyncLLM(tiny_model) as engine:
            slow_steps(engine, 0.02)
            task = asyncio.ensure_future(
                engine.beam_search([prompt], ob.BeamSearchParams(beam_width=4, max_tokens=50))
            )
            # two steps of four one-token requests done: the search is under way
            finished = lambda: engine.metrics()["counters"]["requests_finished"]["length"]  # noqa: E731
            assert await asyncio.to_thread(wait_until, lambda: finished() >= 8)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(wait_until, lambda: engine_idle(engine))

    run(go())


def test_a_full_queue_fails_the_search_and_frees_its_requests(tiny_model, rng):
    (prompt,) = random_prompts(rng, 1)

    async def go() -> None:
        async with ob.AsyncLLM(tiny_model, max_num_seqs=1, max_waiting=2) as engine:
            with pytest.raises(ob.QueueFull):
                await engine.beam_search([prompt], ob.BeamSearchParams(beam_width=4, max_tokens=5))
            assert await asyncio.to_thread(wait_until, lambda: engine_idle(engine))
            assert blocks_held(engine) == 0

    run(go())


def test_a_prompt_past_the_context_is_refused_first(tiny_model):
    async def go() -> None:
        async with ob.AsyncLLM(tiny_model, max_model_len=64) as engine:
            with pytest.raises(ValueError, match="exceed the context"):
                await engine.beam_search([[5] * 60], ob.BeamSearchParams(beam_width=2, max_tokens=8))
            assert engine.metrics()["num_waiting"] == 0

    run(go())

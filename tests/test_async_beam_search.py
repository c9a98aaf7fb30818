"""``AsyncLLM.beam_search``: the beams are those of ``LLM.beam_search`` on the same runner (forked KV
sequences run between engine steps on the native runner, one-token requests on the torch runner),
while another request runs beside them (native; the torch runner's CPU ops are not batch-invariant)
and gets its tokens alone; a cancelled search leaves nothing
running and no block held, as does a full queue (torch) or a cache too small for the beams (native,
a ValueError); a prompt whose beams outgrow the context is refused first."""

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
    def step(beams: list[dict], one: ob.SamplingParams) -> list[ob.RequestOutput]:
        return llm.generate(beams, one, use_tqdm=False)

    stop = set(llm.tokenizer.stop_token_ids)
    return beam_search(
        lambda: EngineBeams(step, params.beam_width), prompts, params, stop, llm.tokenizer.decode
    )


def summary(outputs: list[ob.BeamSearchOutput]) -> list[list[tuple]]:
    return [[(b.tokens, b.cum_logprob, b.text, b.finish_reason) for b in out.sequences] for out in outputs]


RUNNERS = {"native": {}, "torch": {"runner": "torch", "device": "cpu"}}


def runner_args(runner: str) -> dict[str, str]:
    if runner == "torch":
        pytest.importorskip("torch")
    return RUNNERS[runner]


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_the_beams_are_llm_beam_searchs_while_another_request_runs(tiny_model, rng, runner):
    args = runner_args(runner)
    prompts = random_prompts(rng, 2)
    params = ob.BeamSearchParams(
        beam_width=int(rng.integers(2, 5)),
        max_tokens=int(rng.integers(3, 10)),
        length_penalty=float(rng.uniform(0, 2)),
    )
    llm = ob.LLM(tiny_model, **args)
    want = llm.beam_search(prompts, params)
    other = [int(t) for t in rng.integers(0, 800, 30)]
    plain_params = ob.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": other}, plain_params)[0].outputs[0].token_ids

    async def go() -> tuple[list[ob.BeamSearchOutput], ob.RequestOutput]:
        async with ob.AsyncLLM(tiny_model, **args) as engine:

            async def plain() -> ob.RequestOutput:
                last = None
                async for out in engine.generate({"prompt_token_ids": other}, plain_params):
                    last = out
                return last

            if runner == "torch":  # its CPU ops round differently at other batch sizes: search alone
                return await engine.beam_search(prompts, params), await plain()
            got, side = await asyncio.gather(engine.beam_search(prompts, params), plain())
            assert await asyncio.to_thread(wait_until, lambda: engine_idle(engine))
            return got, side

    got, side = run(go())
    assert summary(got) == summary(want)
    assert side.outputs[0].token_ids == alone


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_a_cancelled_search_leaves_nothing_running(tiny_model, rng, runner):
    args = runner_args(runner)
    (prompt,) = random_prompts(rng, 1)

    async def go() -> None:
        async with ob.AsyncLLM(tiny_model, **args) as engine:
            slow_steps(engine, 0.02)
            # A request beside it, so the loop steps (slowly) between the search's pieces.
            side = engine.generate(
                {"prompt_token_ids": prompt}, ob.SamplingParams(max_tokens=400, ignore_eos=True)
            )
            params = ob.BeamSearchParams(beam_width=4, max_tokens=50)
            task = asyncio.ensure_future(engine.beam_search([prompt], params))
            finished = lambda: engine.metrics()["counters"]["requests_finished"]["length"]  # noqa: E731
            # Under way: two steps of four one-token requests done, or forked beams holding blocks.
            under_way = (lambda: finished() >= 8) if runner == "torch" else (lambda: blocks_held(engine) > 3)
            assert await asyncio.to_thread(wait_until, under_way)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await side.aclose()
            assert await asyncio.to_thread(wait_until, lambda: engine_idle(engine))

    run(go())


def test_a_full_queue_fails_the_searchs_requests_and_frees_them(tiny_model, rng):
    args = runner_args("torch")
    (prompt,) = random_prompts(rng, 1)

    async def go() -> None:
        async with ob.AsyncLLM(tiny_model, **args, max_num_seqs=1, max_waiting=2) as engine:
            with pytest.raises(ob.QueueFull):
                await engine.beam_search([prompt], ob.BeamSearchParams(beam_width=4, max_tokens=5))
            assert await asyncio.to_thread(wait_until, lambda: engine_idle(engine))

    run(go())


def test_beams_the_cache_cannot_hold_are_a_value_error_and_free_it(tiny_model, rng):
    """Native: 30 prompt tokens take 2 of the 4 blocks; four beams soon need more than the rest."""
    prompt = [int(t) for t in rng.integers(0, 800, 30)]

    async def go() -> None:
        async with ob.AsyncLLM(tiny_model, kv_cache_blocks=4) as engine:
            with pytest.raises(ValueError, match="cannot hold this beam search"):
                await engine.beam_search([prompt], ob.BeamSearchParams(beam_width=4, max_tokens=40))
            assert blocks_held(engine) == 0
            ok = await engine.beam_search([prompt], ob.BeamSearchParams(beam_width=1, max_tokens=4))
            assert len(ok[0].sequences[0].tokens) == len(prompt) + 4

    run(go())


def test_a_prompt_past_the_context_is_refused_first(tiny_model):
    async def go() -> None:
        async with ob.AsyncLLM(tiny_model, max_model_len=64) as engine:
            with pytest.raises(ValueError, match="exceed the context"):
                await engine.beam_search([[5] * 60], ob.BeamSearchParams(beam_width=2, max_tokens=8))
            assert engine.metrics()["num_waiting"] == 0

    run(go())

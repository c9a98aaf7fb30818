"""``AsyncLLM`` on the embedded default model: concurrent streams give the tokens ``LLM.generate`` gives
alone, aborts and early exits free the KV blocks, submission errors surface before anything is queued,
step errors reach every consumer, and shutdown stops the thread. Where a test needs a request to be
mid-stream, a ``StepGate`` lets the loop run only the steps the test allows, so nothing depends on
timing."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import oxibonsai as ob

from server_support import wait_until

MAX_LEN = 256
WORDS = ["the", "model", "returns", "a", "value", "of", "list", "string", "file", "open", "read", "def"]


def greedy(max_tokens: int) -> ob.SamplingParams:
    return ob.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def words(rng: np.random.Generator, n: int = 6) -> str:
    return " ".join(rng.choice(WORDS, n))


@pytest.fixture(scope="module")
def reference() -> ob.LLM:
    return ob.LLM(max_model_len=MAX_LEN, max_num_seqs=4)


class StepGate:
    """Makes the engine's step wait for a permit; waiting on the AsyncLLM's condition releases its lock,
    so submissions and aborts go through while the loop is held. A permitted step first admits what was
    submitted while it waited (the loop would otherwise admit it one step later)."""

    def __init__(self, engine: ob.AsyncLLM) -> None:
        self._engine = engine
        self._permits = 0
        step = engine._engine.step

        def gated() -> list[ob.RequestOutput]:
            engine._wake.wait_for(lambda: self._permits > 0 or engine._closed)
            self._permits = max(0, self._permits - 1)
            engine._admit_inbox()
            return step()

        engine._engine.step = gated

    def allow(self, steps: int = 1) -> None:
        with self._engine._wake:
            self._permits += steps
            self._engine._wake.notify_all()


async def until_idle(engine: ob.AsyncLLM) -> None:
    deadline = time.monotonic() + 60  # only a failing test waits this long
    while (m := engine.metrics())["num_running"] or m["num_waiting"]:
        assert time.monotonic() < deadline, "the engine did not go idle"
        await asyncio.sleep(0.001)


def assert_all_blocks_free(engine: ob.AsyncLLM) -> None:
    engine.reset_prefix_cache()
    model = engine._llm._runner._model
    assert model.num_free_blocks == model.num_blocks


async def collect(stream: ob.RequestStream) -> list[ob.RequestOutput]:
    return [out async for out in stream]


def test_concurrent_streams_give_the_tokens_of_generate_alone(reference, rng):
    prompts = [words(rng, int(rng.integers(2, 10))) for _ in range(6)]
    params = [greedy(int(rng.integers(4, 24))) for _ in prompts]
    expected = [reference.generate(p, sp)[0].outputs[0] for p, sp in zip(prompts, params, strict=True)]

    async def main() -> list[list[ob.RequestOutput]]:
        async with ob.AsyncLLM(max_model_len=MAX_LEN, max_num_seqs=4) as engine:
            streams = [engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
            return await asyncio.gather(*(collect(s) for s in streams))

    for outs, want, sp in zip(asyncio.run(main()), expected, params, strict=True):
        assert len(outs) == sp.max_tokens  # one cumulative output per step
        for n, out in enumerate(outs, 1):
            assert out.outputs[0].token_ids == want.token_ids[:n]
            assert out.finished == (n == len(outs))
        assert outs[-1].outputs[0].text == want.text and outs[-1].outputs[0].finish_reason == "length"


def test_streams_with_output_work_overlapping_the_next_step_and_an_early_exit(reference, rng):
    """The engine's overlap (``async_output``, the default on CUDA) forced on: every stream gets the
    tokens of ``generate`` alone, one output per step; a consumer that leaves early frees its blocks."""
    prompts = [words(rng, int(rng.integers(2, 10))) for _ in range(5)]
    params = [greedy(int(rng.integers(4, 24))) for _ in prompts]
    expected = [reference.generate(p, sp)[0].outputs[0] for p, sp in zip(prompts, params, strict=True)]
    leaver = int(rng.integers(0, len(prompts)))

    async def consume(stream: ob.RequestStream, leave: bool) -> list[ob.RequestOutput]:
        outs = []
        async for out in stream:
            outs.append(out)
            if leave and len(outs) == 2:
                break
        return outs

    async def main() -> list[list[ob.RequestOutput]]:
        async with ob.AsyncLLM(max_model_len=MAX_LEN, max_num_seqs=4) as engine:
            engine._llm._runner.async_output = True
            streams = [engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
            outs = await asyncio.gather(*(consume(s, i == leaver) for i, s in enumerate(streams)))
            await until_idle(engine)
            assert_all_blocks_free(engine)
            return outs

    for i, (outs, want) in enumerate(zip(asyncio.run(main()), expected, strict=True)):
        assert len(outs) == (2 if i == leaver else len(want.token_ids))
        for n, out in enumerate(outs, 1):
            assert out.outputs[0].token_ids == want.token_ids[:n]
        if i != leaver:
            assert outs[-1].finished and outs[-1].outputs[0].text == want.text


def test_prompt_forms_and_request_ids(reference, rng):
    text = words(rng)
    ids = reference.tokenizer.encode(text)
    want = reference.generate(text, greedy(6))[0].outputs[0].token_ids
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids, "cache_salt": "tenant"}]

    async def main() -> list[list[ob.RequestOutput]]:
        async with ob.AsyncLLM(max_model_len=MAX_LEN) as engine:
            streams = [engine.generate(f, greedy(6), request_id=f"r{i}") for i, f in enumerate(forms)]
            assert [s.request_id for s in streams] == ["r0", "r1", "r2", "r3"]
            return await asyncio.gather(*(collect(s) for s in streams))

    for i, outs in enumerate(asyncio.run(main())):
        assert outs[-1].request_id == f"r{i}" and outs[-1].outputs[0].token_ids == want


def test_abort_mid_stream_ends_the_stream_and_frees_the_blocks(rng):
    async def main() -> None:
        async with ob.AsyncLLM(max_model_len=MAX_LEN) as engine:
            gate = StepGate(engine)
            stream = engine.generate(words(rng), greedy(200), request_id="long")
            gate.allow(3)
            seen = [await stream.__anext__() for _ in range(3)]
            assert engine.abort("long") and not engine.abort("long") and not engine.abort("unknown")
            last = await collect(stream)
            assert len(last) == 1 and last[0].finished and last[0].outputs[0].finish_reason == "abort"
            assert last[0].outputs[0].token_ids == seen[-1].outputs[0].token_ids
            m = engine.metrics()
            assert m["num_running"] == m["num_waiting"] == 0
            assert m["counters"]["requests_finished"]["abort"] == 1
            assert_all_blocks_free(engine)

    asyncio.run(main())


def test_abort_before_the_first_token(rng):
    async def main() -> None:
        async with ob.AsyncLLM(max_model_len=MAX_LEN) as engine:
            StepGate(engine)
            stream = engine.generate(words(rng), greedy(10))
            assert engine.abort(stream.request_id)
            outs = await collect(stream)
            assert len(outs) == 1 and outs[0].outputs[0].token_ids == []
            assert outs[0].outputs[0].finish_reason == "abort" and outs[0].finished
            assert_all_blocks_free(engine)

    asyncio.run(main())


def test_breaking_out_of_async_for_aborts(rng):
    prompt = words(rng)

    async def main() -> None:
        async with ob.AsyncLLM(max_model_len=MAX_LEN) as engine:
            gate = StepGate(engine)
            gate.allow(2)
            n = 0
            async for _ in engine.generate(prompt, greedy(200)):
                n += 1
                if n == 2:
                    break
            gate.allow(1000)
            await until_idle(engine)
            computed = engine.cache_stats()["computed_tokens"]
            assert computed < len(engine.tokenizer.encode(prompt)) + 10  # nowhere near 200 tokens
            assert_all_blocks_free(engine)

    asyncio.run(main())


def test_aclose_and_task_cancellation_abort_at_once(rng):
    async def main() -> None:
        async with ob.AsyncLLM(max_model_len=MAX_LEN) as engine:
            gate = StepGate(engine)
            stream = engine.generate(words(rng), greedy(100))
            gate.allow(1)
            await stream.__anext__()
            await stream.aclose()
            assert engine.metrics()["num_running"] == 0
            assert await collect(stream) == []

            got_one = asyncio.Event()
            second = engine.generate(words(rng), greedy(100))  # queued before the gate opens

            async def consume() -> None:
                async for _ in second:
                    got_one.set()

            task = asyncio.create_task(consume())
            gate.allow(1)
            await got_one.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            m = engine.metrics()
            assert m["num_running"] == m["num_waiting"] == 0
            assert_all_blocks_free(engine)

    asyncio.run(main())


def test_invalid_requests_raise_before_anything_is_queued(rng):
    with pytest.raises(ValueError):
        ob.SamplingParams(temperature=-1.0)

    async def main() -> None:
        async with ob.AsyncLLM(max_model_len=MAX_LEN) as engine:
            gate = StepGate(engine)
            kept = engine.generate(words(rng), greedy(4), request_id="kept")
            bad: list[tuple[type[Exception], object, object]] = [
                (TypeError, words(rng), {"temperature": 0.0}),
                (ValueError, [1] * MAX_LEN, greedy(1)),  # no room for a generated token
                (ValueError, [], greedy(1)),
                (ValueError, [engine._llm._runner._model.vocab_size], greedy(1)),
                (ValueError, {"text": "no prompt key"}, greedy(1)),
                (TypeError, {"prompt": "x", "cache_salt": 3}, greedy(1)),
            ]
            for error, prompt, params in bad:
                with pytest.raises(error):
                    engine.generate(prompt, params)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="already in use"):
                engine.generate(words(rng), greedy(4), request_id="kept")
            m = engine.metrics()
            assert m["num_waiting"] + m["num_running"] == 1
            gate.allow(1000)
            outs = await collect(kept)
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4

    asyncio.run(main())


def test_engine_raises_queue_full_when_max_waiting_requests_wait(rng):
    llm = ob.LLM(max_model_len=MAX_LEN, max_num_seqs=1, max_waiting=2)
    engine = llm._engine
    for i in range(2):
        ids = llm.tokenizer.encode(words(rng))
        engine.add_request(str(i), None, ids, greedy(4))
    with pytest.raises(ob.QueueFull):
        engine.add_request("2", None, llm.tokenizer.encode(words(rng)), greedy(4))
    assert engine.num_waiting == 2
    assert isinstance(ob.QueueFull("x"), ob.OxiBonsaiError)


def test_async_generate_raises_queue_full_at_once(rng):
    async def main() -> None:
        async with ob.AsyncLLM(max_model_len=MAX_LEN, max_num_seqs=1, max_waiting=2) as engine:
            gate = StepGate(engine)  # nothing is admitted: every request waits
            streams = [engine.generate(words(rng), greedy(3)) for _ in range(2)]
            with pytest.raises(ob.QueueFull):
                engine.generate(words(rng), greedy(3))
            assert engine.metrics()["num_waiting"] == 2
            gate.allow(1000)
            for outs in await asyncio.gather(*(collect(s) for s in streams)):
                assert outs[-1].finished

    asyncio.run(main())


def test_a_dropped_waiting_request_frees_its_queue_place_at_once(rng):
    """With one request running and one waiting in the engine, ``max_waiting=1`` is full; once the
    waiting one's consumer leaves, a new request is taken before any further step (the waiting count
    is recounted at the drop, not at a next step)."""

    async def main() -> None:
        async with ob.AsyncLLM(max_model_len=MAX_LEN, max_num_seqs=1, max_waiting=1) as engine:
            gate = StepGate(engine)
            running = engine.generate(words(rng), greedy(50))
            gate.allow(1)
            await asyncio.to_thread(wait_until, lambda: engine.metrics()["num_running"] == 1)
            waiting = engine.generate(words(rng), greedy(3))
            with pytest.raises(ob.QueueFull):
                engine.generate(words(rng), greedy(3))
            gate.allow(1)  # admits the waiting one into the engine's queue
            await asyncio.to_thread(wait_until, lambda: engine.metrics()["num_waiting"] == 1)
            await waiting.aclose()
            later = engine.generate(words(rng), greedy(2))
            gate.allow(1000)
            assert (await collect(later))[-1].finished and (await collect(running))[-1].finished

    asyncio.run(main())


def test_a_failing_step_reaches_every_consumer(rng):
    def broken() -> list[ob.RequestOutput]:
        raise RuntimeError("boom")

    async def main() -> None:
        engine = ob.AsyncLLM(max_model_len=MAX_LEN)
        engine._engine.step = broken
        gate = StepGate(engine)  # so that all three are queued before the first step
        streams = [engine.generate(words(rng), greedy(5)) for _ in range(3)]
        gate.allow(1)
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        for r in results:
            assert isinstance(r, ob.EngineDeadError) and isinstance(r.__cause__, RuntimeError)
        engine._thread.join(60)
        assert not engine.is_running
        with pytest.raises(ob.EngineDeadError):
            engine.generate(words(rng), greedy(5))
        engine.shutdown()

    asyncio.run(main())


def test_shutdown_ends_streams_and_stops_the_thread(rng):
    async def main() -> None:
        engine = ob.AsyncLLM(max_model_len=MAX_LEN)
        StepGate(engine)
        stream = engine.generate(words(rng), greedy(50))
        assert engine.is_running
        engine.shutdown()
        assert not engine.is_running
        outs = await collect(stream)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(ob.EngineDeadError):
            engine.generate(words(rng), greedy(5))
        engine.shutdown()  # idempotent
        assert_all_blocks_free(engine)

    asyncio.run(main())


def test_metrics_count_finished_requests(rng):
    lengths = [int(n) for n in rng.integers(2, 12, size=4)]

    async def main() -> None:
        async with ob.AsyncLLM(max_model_len=MAX_LEN) as engine:
            await asyncio.gather(*(collect(engine.generate(words(rng), greedy(n))) for n in lengths))
            m = engine.metrics()
            assert m["counters"]["requests_finished"]["length"] == len(lengths)
            assert m["counters"]["generation_tokens_total"] == sum(lengths)
            assert m["counters"]["prompt_tokens_total"] > 0
            for h in m["histograms"].values():
                assert h["count"] == len(lengths) and h["p50"] is not None
            text = engine.prometheus_metrics()
            assert f'oxibonsai_requests_finished_total{{finished_reason="length"}} {len(lengths)}' in text

    asyncio.run(main())


def test_event_loops_on_several_threads_share_one_engine(reference, rng):
    prompts = [[words(rng) for _ in range(3)] for _ in range(2)]
    expected = [[reference.generate(p, greedy(8))[0].outputs[0].token_ids for p in ps] for ps in prompts]
    results: list[list[list[int]] | None] = [None, None]
    engine = ob.AsyncLLM(max_model_len=MAX_LEN)

    def client(i: int) -> None:
        async def main() -> list[list[int]]:
            outs = await asyncio.gather(*(collect(engine.generate(p, greedy(8))) for p in prompts[i]))
            return [o[-1].outputs[0].token_ids for o in outs]

        results[i] = asyncio.run(main())

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.shutdown()
    assert results == expected


def test_generate_and_dropping_do_not_wait_for_a_running_step(rng):
    """A step holds the engine lock for its whole length (up to a second on a big model); submitting
    or leaving a stream meanwhile must not block the caller's event loop. The step here is held open
    on an event; a caller that waited for it would never return."""
    release = threading.Event()
    entered = threading.Event()

    async def main() -> None:
        engine = ob.AsyncLLM(max_model_len=MAX_LEN, max_num_seqs=1, max_waiting=3)
        step = engine._engine.step

        def held_step() -> list[ob.RequestOutput]:
            entered.set()
            release.wait()
            return step()

        engine._engine.step = held_step
        try:
            first = engine.generate(words(rng), greedy(3))
            await asyncio.to_thread(entered.wait, 30)  # the loop is inside the step, holding the lock
            second = engine.generate(words(rng), greedy(3))  # returns at once: it goes to the inbox
            left = engine.generate(words(rng), greedy(3))
            with pytest.raises(ob.QueueFull):  # the first (waiting in the engine) and the inbox count
                engine.generate(words(rng), greedy(3))
            with pytest.raises(ValueError):  # and validation still happens at submission
                engine.generate([], greedy(3))
            dropper = threading.Thread(target=engine._drop, args=(left.request_id,))
            dropper.start()
            dropper.join(30)
            assert not dropper.is_alive(), "dropping a stream waited for the step"
            release.set()
            for outs in await asyncio.gather(collect(first), collect(second)):
                assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
            await until_idle(engine)
            counters = engine.metrics()["counters"]
            assert counters["generation_tokens_total"] == 6, "the dropped request left the inbox unrun"
            assert counters["requests_finished"]["abort"] == 0
            assert_all_blocks_free(engine)
        finally:
            release.set()
            engine.shutdown()

    asyncio.run(main())

"""Embeddings: the final hidden states (``hidden_states``, both runners) against the float64 numpy
reference's, ``LLM.embed``'s pooling (last, mean, cls; normalized or not) of exactly those states, the
GGUF's pooling type, ``AsyncLLM.embed`` beside running requests (their tokens unchanged, no KV block
kept; a chunk between two steps, waiting for blocks, cancelled, shut down), and ``/v1/embeddings``
(float and base64, token-id inputs, the official client, errors)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai.embedding import model_pooling, pooled

from qwen3_reference import ReferenceQwen3, rms_norm
from server_support import asgi_client, blocks_held, run

EXACT = {"kernel": "reference", "kv_cache_dtype": "f32"}


def random_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def reference_hidden(path: Path, ids: list[int]) -> np.ndarray:
    ref = ReferenceQwen3.from_gguf(path)
    return rms_norm(ref.hidden_states(ids), ref.w["output_norm.weight"], ref.hp.rms_eps)


@pytest.mark.parametrize("runner", ["native", "torch"])
def test_hidden_states_match_the_reference(tiny_model, tiny_untied_model, rng, runner):
    if runner == "torch":
        pytest.importorskip("torch")
    for path in (tiny_model, tiny_untied_model):
        extra = {"runner": "torch", "device": "cpu", "kv_cache_dtype": "f32"} if runner == "torch" else EXACT
        llm = ob.LLM(path, **extra)
        ids = random_ids(rng, llm.config["vocab"], int(rng.integers(1, 60)))
        ours = llm._runner.hidden_states(ids)
        assert ours.shape == (len(ids), llm.config["hidden"])
        np.testing.assert_allclose(ours, reference_hidden(path, ids), atol=2e-3, rtol=0)
        np.testing.assert_array_equal(llm._runner.hidden_states(ids, "last"), ours[-1:])


def test_embed_pools_the_hidden_states(tiny_model, rng):
    llm = ob.LLM(tiny_model)
    prompts = [random_ids(rng, llm.config["vocab"], int(n)) for n in rng.integers(1, 40, 3)]
    for pooling in ("last", "mean", "cls"):
        for normalize in (True, False):
            outs = llm.embed(prompts, pooling=pooling, normalize=normalize)
            assert [o.prompt_token_ids for o in outs] == prompts and all(o.finished for o in outs)
            for out, ids in zip(outs, prompts, strict=True):
                hidden = llm._runner.hidden_states(ids).astype(np.float64)
                want = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
                if normalize:
                    want = want / np.linalg.norm(want)
                got = np.asarray(out.outputs.embedding)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
                assert not normalize or abs(np.linalg.norm(got) - 1) < 1e-5
    text = llm.embed("hello world")[0]
    assert text.prompt_token_ids == llm.tokenizer.encode("hello world")
    with pytest.raises(ValueError, match="pooling must be one of"):
        llm.embed("x", pooling="max")
    with pytest.raises(ValueError, match="exceed the context"):
        llm.embed([[1] * (llm.max_model_len + 1)])
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])


def test_the_gguf_names_the_pooling():
    assert model_pooling({"general.architecture": "qwen3"}) == "last"
    assert model_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": 1}) == "mean"
    assert model_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": 2}) == "cls"
    zeros = pooled(np.zeros((3, 4), np.float32), "mean", True)
    assert not np.isnan(zeros).any(), "a zero vector stays zero rather than NaN"


def test_async_embed_beside_running_requests_changes_nothing(tiny_model, rng):
    prompts = [random_ids(rng, 300, int(n)) for n in rng.integers(5, 30, 3)]
    params = ob.SamplingParams(max_tokens=12, temperature=0.8, seed=int(rng.integers(2**32)), ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ob.LLM(tiny_model).generate(prompts, params)]
    engine = ob.AsyncLLM(tiny_model)

    async def go() -> tuple[list[list[int]], list[Any]]:
        async def one(i: int) -> list[int]:
            last = None
            async for out in engine.generate(prompts[i], params, request_id=f"r{i}"):
                last = out
            assert last is not None
            return last.outputs[0].token_ids

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        embedded = await engine.embed(prompts)
        return list(await asyncio.gather(*tasks)), embedded

    try:
        got, embedded = asyncio.run(go())
        assert got == want
        alone = ob.LLM(tiny_model).embed(prompts)
        assert [e.outputs.embedding for e in embedded] == [a.outputs.embedding for a in alone]
        assert blocks_held(engine) == 0
    finally:
        engine.shutdown()


def test_hidden_states_in_chunks_are_the_same_bits(tiny_model, rng):
    llm = ob.LLM(tiny_model)
    runner = llm._runner
    free = runner._model.num_free_blocks
    ids = random_ids(rng, llm.config["vocab"], int(rng.integers(40, 300)))
    chunk = int(rng.integers(1, 64))
    for rows in ("all", "last"):
        steps = runner.hidden_state_steps(ids, rows, chunk)
        needs = []
        try:
            while True:
                needs.append(next(steps))
        except StopIteration as done:
            hidden = done.value
        np.testing.assert_array_equal(hidden, runner.hidden_states(ids, rows))
        assert len(needs) == -(-len(ids) // chunk) and sum(needs) == -(-len(ids) // 16)
        assert runner._model.num_free_blocks == free
    steps = runner.hidden_state_steps(ids, "all", 16)
    next(steps), next(steps), next(steps)  # two chunks ran
    assert runner._model.num_free_blocks == free - 2
    steps.close()
    assert runner._model.num_free_blocks == free, "closing the steps frees their sequence"


@contextlib.contextmanager
def parked(engine: ob.AsyncLLM) -> Iterator[None]:
    """Holds the step loop before its next turn (as a caller waiting for the engine lock does), so
    work submitted meanwhile joins the engine in the state it has now. Waits for the turn under way
    to end first (it could otherwise run a piece of what is submitted here after its step)."""
    with engine._work:
        engine._control_waiting += 1
    try:
        with engine._lock:
            pass
        yield
    finally:
        with engine._work:
            engine._control_waiting -= 1
            engine._work.notify_all()


async def embedding_queued(engine: ob.AsyncLLM, prompts: list[list[int]]) -> asyncio.Future[Any]:
    """``engine.embed(prompts)`` started, once its job is in the loop's queue."""
    queued = len(engine._jobs)
    job = asyncio.ensure_future(engine.embed(prompts))
    while not job.done() and len(engine._jobs) == queued:
        await asyncio.sleep(0.001)
    return job


def test_async_embed_runs_between_steps(tiny_model, rng):
    """A long embedding does not hold running requests back: with 16-token chunks a 400-token prompt
    takes 25 turns of the loop, each after an engine step, so a request decoding beside it gets a step
    in every turn (and the same tokens as alone)."""
    stream_ids, embed_ids = random_ids(rng, 800, 20), random_ids(rng, 800, 400)
    params = ob.SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    want = ob.LLM(tiny_model).generate([stream_ids], params)[0].outputs[0].token_ids
    engine = ob.AsyncLLM(tiny_model, max_num_batched_tokens=16)
    step = engine._engine.step
    steps_beside: list[int] = []

    def counted_step() -> Any:
        steps_beside.append(len(engine._jobs))
        return step()

    engine._engine.step = counted_step  # type: ignore[method-assign]

    async def go() -> tuple[list[int], Any]:
        stream = engine.generate(stream_ids, params)
        await stream.__anext__()  # running now
        with parked(engine):
            embedding = await embedding_queued(engine, [embed_ids])
        out = [o async for o in stream][-1]
        return out.outputs[0].token_ids, (await embedding)[0]

    try:
        tokens, embedded = asyncio.run(go())
        assert tokens == want
        assert sum(1 for pending in steps_beside if pending) == 25, "steps waited for the embedding"
        assert embedded.outputs.embedding == ob.LLM(tiny_model).embed([embed_ids])[0].outputs.embedding
        assert blocks_held(engine) == 0
    finally:
        engine.shutdown()


def test_async_embed_waits_for_blocks_and_fails_when_they_never_come(tiny_model, rng):
    """In a cache of 8 blocks, a 100-token embedding (7 blocks) beside a request that grows to 6 takes
    the free blocks a chunk at a time; the request, out of blocks, is preempted, and the embedding goes
    on and ends, then the request resumes (its tokens unchanged). One larger than the cache is a
    ValueError; a cancelled one is dropped before its next chunk. No block is kept."""
    stream_ids, embed_ids = random_ids(rng, 800, 60), random_ids(rng, 800, 100)
    params = ob.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = ob.LLM(tiny_model).generate([stream_ids], params)[0].outputs[0].token_ids
    engine = ob.AsyncLLM(tiny_model, max_num_batched_tokens=16, kv_cache_blocks=8, max_model_len=256)

    async def go() -> tuple[list[int], Any]:
        with parked(engine):  # both start in the same turn of the loop
            stream = engine.generate(stream_ids, params)
            embedding = await embedding_queued(engine, [embed_ids])
        out = [o async for o in stream][-1]
        embedded = await embedding
        with pytest.raises(ValueError, match="cannot hold this embedding prompt"):
            await engine.embed([random_ids(rng, 800, 200)])
        with parked(engine):
            cancelled = await embedding_queued(engine, [random_ids(rng, 800, 120)])
            cancelled.cancel()
        await engine.embed([embed_ids[:5]])  # after the cancelled job, in order
        assert cancelled.cancelled()
        return out.outputs[0].token_ids, embedded[0]

    try:
        tokens, embedded = asyncio.run(go())
        assert tokens == want
        assert engine._engine.scheduler_stats()["preemptions"] >= 1
        assert embedded.outputs.embedding == ob.LLM(tiny_model).embed([embed_ids])[0].outputs.embedding
        assert blocks_held(engine) == 0
    finally:
        engine.shutdown()


def test_an_embedding_waits_for_another_jobs_blocks(tiny_model, rng):
    """In a cache of 7 blocks with 64-token chunks, a 100-token embedding takes 4 blocks, then 3; a
    70-token one queued beside it needs 4 at once, so it waits for the first to end (it used to fail,
    nothing running)."""
    engine = ob.AsyncLLM(tiny_model, max_num_batched_tokens=64, kv_cache_blocks=7, max_model_len=128)
    first, second = random_ids(rng, 800, 100), random_ids(rng, 800, 70)

    async def go() -> list[Any]:
        with parked(engine):  # both start in the same turn of the loop
            jobs = [await embedding_queued(engine, [ids]) for ids in (first, second)]
        return [(await job)[0] for job in jobs]

    try:
        done = asyncio.run(go())
        alone = ob.LLM(tiny_model).embed([first, second])
        assert [d.outputs.embedding for d in done] == [a.outputs.embedding for a in alone]
        assert blocks_held(engine) == 0
    finally:
        engine.shutdown()


def test_of_two_embeddings_holding_what_the_other_needs_one_fails(tiny_model, rng):
    """32-token chunks (2 blocks) of two 100-token embeddings in 7 blocks: after two chunks each, 1
    block is free and both need 2; nothing else will free any, so one fails and the other ends."""
    engine = ob.AsyncLLM(tiny_model, max_num_batched_tokens=32, kv_cache_blocks=7, max_model_len=128)
    prompts = [random_ids(rng, 800, 100) for _ in range(2)]

    async def go() -> list[Any]:
        with parked(engine):
            jobs = [await embedding_queued(engine, [ids]) for ids in prompts]
        return await asyncio.gather(*jobs, return_exceptions=True)

    try:
        outcomes = asyncio.run(go())
        failed = [i for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        assert len(failed) == 1, outcomes
        error, (ok,) = outcomes[failed[0]], [o for o in outcomes if not isinstance(o, BaseException)]
        assert isinstance(error, ValueError) and "cannot hold this embedding prompt" in str(error)
        want = ob.LLM(tiny_model).embed([prompts[1 - failed[0]]])[0]
        assert ok[0].outputs.embedding == want.outputs.embedding
        assert blocks_held(engine) == 0
    finally:
        engine.shutdown()


def test_shutdown_fails_a_waiting_embedding(tiny_model, rng):
    engine = ob.AsyncLLM(tiny_model, max_num_batched_tokens=16)

    async def go() -> None:
        with parked(engine):
            job = await embedding_queued(engine, [random_ids(rng, 800, 400)])
            await asyncio.to_thread(engine.shutdown)
        with pytest.raises(ob.EngineDeadError, match="shut down"):
            await job

    asyncio.run(go())
    assert engine.cache_stats()["free_blocks"] == engine.cache_stats()["capacity_blocks"]


def post(app: Any, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with asgi_client(app) as c:
            return await c.post("/v1/embeddings", json=body)

    return run(go())


def test_the_route_gives_llm_embed_in_float_and_base64(default_app, default_engine):
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran"]
    rng = random.Random()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in range(3)]
    want = ob.LLM(None).embed(texts)
    r = post(default_app, {"input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in body["data"]] == [w.outputs.embedding for w in want]
    tokens = sum(len(w.prompt_token_ids) for w in want)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    packed = post(default_app, {"input": texts[0], "encoding_format": "base64"}).json()["data"][0][
        "embedding"
    ]
    vector = np.frombuffer(base64.b64decode(packed), dtype="<f4")
    assert vector.tolist() == want[0].outputs.embedding
    ids = want[1].prompt_token_ids
    assert post(default_app, {"input": ids}).json()["data"][0]["embedding"] == want[1].outputs.embedding
    assert len(post(default_app, {"input": [ids, ids]}).json()["data"]) == 2


def test_the_openai_client_reads_embeddings(default_app):
    openai = pytest.importorskip("openai")

    async def go() -> Any:
        client = openai.AsyncOpenAI(
            base_url="http://testserver/v1",
            api_key="unused",
            http_client=asgi_client(default_app),
            max_retries=0,
        )
        return await client.embeddings.create(model="bonsai", input=["hello world", "the cat"])

    result = asyncio.run(go())
    want = ob.LLM(None).embed(["hello world", "the cat"])
    got = [np.asarray(d.embedding, dtype=np.float32) for d in result.data]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, np.asarray(w.outputs.embedding, dtype=np.float32))


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": []}, 400, "input must not be empty"),
        ({"input": ""}, 400, "has no tokens"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "dimensions": 7}, 400, "dimensions must be the model's"),
        ({"input": [[1] * 5000]}, 400, "maximum context length"),
        ({"input": "x", "model": "nope"}, 404, "nope"),
    ],
)
def test_bad_embedding_requests(default_app, body, status, message):
    r = post(default_app, body)
    assert r.status_code == status, r.text
    assert message in r.text

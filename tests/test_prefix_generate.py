"""Prefix caching end to end on tiny random models: greedy outputs with the cache on equal those with it
off, token for token (also with a pool so small that nearly every request evicts, and with tenants kept
apart by ``cache_salt``); a cached prefix is not computed again (counted by ``computed_tokens``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import oxibonsai as ob

GREEDY = ob.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def random_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def shared_prefix_prompts(rng: np.random.Generator, vocab: int, n: int) -> list[list[int]]:
    """`n` prompts drawn from a few random prefixes (0 to 70 tokens) with random tails (1 to 20)."""
    prefixes = [random_ids(rng, vocab, int(rng.integers(0, 70))) for _ in range(3)]
    return [
        prefixes[int(rng.integers(0, 3))] + random_ids(rng, vocab, int(rng.integers(1, 20))) for _ in range(n)
    ]


def token_lists(outs: list[ob.RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def uncached(tiny_model: Path) -> ob.LLM:
    return ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)


def test_cached_and_uncached_greedy_outputs_are_identical(tiny_model, uncached, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4)
    vocab = llm.config["vocab"]
    prompts = shared_prefix_prompts(rng, vocab, 12)
    want = token_lists(uncached.generate(prompts, GREEDY))
    # Twice: the first pass fills the cache (and shares blocks between requests running together),
    # the second starts every request on cached blocks.
    assert token_lists(llm.generate(prompts, GREEDY)) == want
    outs = llm.generate(prompts, GREEDY)
    assert token_lists(outs) == want
    assert all(o.num_cached_tokens == 16 * ((len(o.prompt_token_ids) - 1) // 16) for o in outs)
    stats = llm.cache_stats()
    assert stats["enabled"] and stats["hits"] > 0 and stats["hit_tokens"] > 0
    assert uncached.cache_stats()["cached_blocks"] == 0 and not uncached.cache_stats()["enabled"]


def test_a_tiny_pool_evicts_on_nearly_every_request_and_changes_nothing(tiny_model, uncached, rng):
    prompts = [random_ids(rng, 300, int(rng.integers(20, 60))) for _ in range(4)]
    prompts += [p[: int(rng.integers(1, len(p)))] + random_ids(rng, 300, 5) for p in prompts]
    # Room for one request at a time, plus a block: new requests must evict cached blocks (how many
    # depends on the drawn lengths: short prompts reuse or fit in a free block, so no per-request bound).
    blocks = max(-(-(len(p) + GREEDY.max_tokens) // 16) for p in prompts) + 1
    llm = ob.LLM(tiny_model, max_model_len=256, kv_cache_blocks=blocks, max_num_seqs=4)
    got = [token_lists(llm.generate(p, GREEDY))[0] for p in prompts + prompts[::-1]]
    want = token_lists(uncached.generate(prompts + prompts[::-1], GREEDY))
    assert got == want
    stats = llm.cache_stats()
    assert stats["evictions"] > 0 and stats["capacity_blocks"] == blocks
    assert stats["free_blocks"] + stats["idle_blocks"] == blocks


def test_cache_salt_keeps_tenants_apart(tiny_model, uncached, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4)
    ids = random_ids(rng, llm.config["vocab"], 50)
    want = token_lists(uncached.generate(ids, GREEDY))[0]

    def run(salt: str | None) -> int:
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        before = llm.cache_stats()["hit_tokens"]
        out = llm.generate(prompt, GREEDY)[0]
        assert out.outputs[0].token_ids == want
        assert out.num_cached_tokens == llm.cache_stats()["hit_tokens"] - before
        return out.num_cached_tokens

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0, "another tenant's blocks were shared"
    assert run(None) == 0
    assert run("tenant-a") == 48
    assert run("tenant-b") == 48
    assert llm.cache_stats()["hits"] == 2
    with pytest.raises(TypeError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": 7}, GREEDY)


def test_a_cached_1024_token_prefix_is_not_computed_again(tmp_path_factory, model_seed, rng):
    from models import tiny_config, write_tiny

    path = write_tiny(
        tmp_path_factory.mktemp("long") / "long.gguf", model_seed + 2, cfg=tiny_config(context_length=2048)
    )
    llm = ob.LLM(path, max_model_len=1200, max_num_seqs=2)
    vocab = llm.config["vocab"]
    prefix = random_ids(rng, vocab, 1024)
    first, second = prefix + random_ids(rng, vocab, 7), prefix + random_ids(rng, vocab, 23)
    one = ob.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(first, one)
    before = llm.cache_stats()
    out = llm.generate(second, one)[0]
    after = llm.cache_stats()
    assert out.num_cached_tokens == 1024
    assert after["computed_tokens"] - before["computed_tokens"] == 23
    assert after["hit_tokens"] - before["hit_tokens"] == 1024
    cold = ob.LLM(path, max_model_len=1200, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == cold.generate(second, one)[0].outputs[0].token_ids
    assert cold.cache_stats()["computed_tokens"] == len(second)


def test_reset_drops_the_cache_and_streams_share_it(tiny_model, rng):
    llm = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=2)
    ids = random_ids(rng, llm.config["vocab"], 40)
    streamed = list(llm.stream(ids, GREEDY))[-1]
    assert streamed.num_cached_tokens == 0 and llm.cache_stats()["cached_blocks"] == 2
    assert llm.generate(ids, GREEDY)[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache() == 2
    stats = llm.cache_stats()
    assert stats["cached_blocks"] == 0 and stats["free_blocks"] == stats["capacity_blocks"]
    assert llm.generate(ids, GREEDY)[0].num_cached_tokens == 0


def test_admission_counts_only_the_uncached_blocks(tiny_model, uncached, rng):
    # 7 blocks; each request's worst case is 5 (64 + 8 prompt tokens, 8 new). Without the cache only
    # one fits at a time; with its 4 prefix blocks cached, the second costs its one private block.
    llm = ob.LLM(tiny_model, max_model_len=256, kv_cache_blocks=7, max_num_seqs=2)
    prefix = random_ids(rng, 300, 64)
    llm.generate(prefix + random_ids(rng, 300, 3), GREEDY)
    prompts = [prefix + random_ids(rng, 300, 8) for _ in range(2)]
    params = ob.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm._engine.add_request(f"r{i}", None, p, params)
    llm._engine.step()
    assert llm._engine.num_running == 2
    outs = {}
    while llm._engine.has_unfinished():
        outs.update({o.request_id: o for o in llm._engine.step()})
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(2)] == token_lists(
        uncached.generate(prompts, params)
    )
    assert llm.cache_stats()["free_blocks"] + llm.cache_stats()["idle_blocks"] == 7

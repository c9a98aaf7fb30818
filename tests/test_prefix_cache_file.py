"""Prefix-cache files (``LLM.save_prefix_cache`` / ``load_prefix_cache``, ``AsyncLLM``'s, the server's
``--prefix-cache-file``): a cache saved by one engine and loaded by another serves the same prompts
from cache with the tokens an uncached engine gives; salts stay apart; a pool too small for the file
keeps whole chains; a file for another model or settings, a truncated, corrupt or foreign file is
refused with a ``ValueError`` and changes nothing it has not verified."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

import oxibonsai as ob

from models import write_tiny

GREEDY = ob.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    return write_tiny(tmp_path_factory.mktemp("cache-file") / "model.gguf", model_seed + 60)


def shared_prompts(rng: np.random.Generator, n: int = 4) -> list[list[int]]:
    """Prompts behind one long system prefix, each with its own tail."""
    system = [int(t) for t in rng.integers(0, 300, int(rng.integers(40, 90)))]
    return [system + [int(t) for t in rng.integers(0, 300, int(rng.integers(1, 40)))] for _ in range(n)]


def tokens(outputs: list[ob.RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def saved(model: Path, path: Path, prompts: list, **kwargs: object) -> ob.LLM:
    llm = ob.LLM(model, max_model_len=256, **kwargs)  # type: ignore[arg-type]
    llm.generate(prompts, GREEDY)
    assert llm.save_prefix_cache(path) == llm.cache_stats()["cached_blocks"] > 0
    return llm


def test_a_loaded_cache_serves_the_prompts_it_was_saved_from(model: Path, tmp_path: Path, rng) -> None:
    prompts = shared_prompts(rng)
    writer = saved(model, tmp_path / "c.bin", prompts)
    fresh = ob.LLM(model, max_model_len=256)
    assert fresh.load_prefix_cache(tmp_path / "c.bin") == writer.cache_stats()["cached_blocks"]
    assert fresh.cache_stats()["cached_blocks"] == writer.cache_stats()["cached_blocks"]
    outs = fresh.generate(prompts, GREEDY)
    uncached = ob.LLM(model, max_model_len=256, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert tokens(outs) == tokens(uncached)
    assert all(o.num_cached_tokens == 16 * ((len(p) - 1) // 16) for o, p in zip(outs, prompts, strict=True))
    assert fresh.cache_stats()["computed_tokens"] < sum(map(len, prompts))


def test_loading_twice_or_over_the_same_blocks_changes_nothing(model: Path, tmp_path: Path, rng) -> None:
    prompts = shared_prompts(rng)
    writer = saved(model, tmp_path / "c.bin", prompts)
    n = writer.cache_stats()["cached_blocks"]
    assert writer.load_prefix_cache(tmp_path / "c.bin") == n  # already cached: counted, not copied
    assert writer.cache_stats()["cached_blocks"] == n and writer.cache_stats()["free_blocks"] == 128 - n


def test_salts_stay_apart_after_a_load(model: Path, tmp_path: Path, rng) -> None:
    prompt = shared_prompts(rng, 1)[0]
    saved(model, tmp_path / "c.bin", [{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}])
    fresh = ob.LLM(model, max_model_len=256)
    fresh.load_prefix_cache(tmp_path / "c.bin")
    other = fresh.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], GREEDY)[0]
    unsalted = fresh.generate([prompt], GREEDY)[0]
    same = fresh.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY)[0]
    assert other.num_cached_tokens == unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens == 16 * ((len(prompt) - 1) // 16) > 0
    assert same.outputs[0].token_ids == unsalted.outputs[0].token_ids


def test_a_small_pool_loads_whole_chains_only(model: Path, tmp_path: Path, rng) -> None:
    prompts = shared_prompts(rng, 6)
    writer = saved(model, tmp_path / "c.bin", prompts)
    n = writer.cache_stats()["cached_blocks"]
    small = ob.LLM(model, max_model_len=256, kv_cache_blocks=16)
    room = int(rng.integers(1, min(n, 16)))
    small.generate([[2] * (16 * (16 - room))], ob.SamplingParams(max_tokens=1))  # cached, idle: kept
    assert small.cache_stats()["free_blocks"] == room
    assert small.load_prefix_cache(tmp_path / "c.bin") == room  # roots first, then their children
    first = small.generate(prompts[:1], GREEDY)[0]
    assert first.num_cached_tokens > 0 and first.num_cached_tokens % 16 == 0
    outs = small.generate(prompts, GREEDY)
    assert tokens(outs) == tokens(writer.generate(prompts, GREEDY))


def test_files_for_another_model_or_settings_are_refused(
    model: Path, tmp_path: Path, rng, model_seed
) -> None:
    saved(model, tmp_path / "c.bin", shared_prompts(rng))
    other = write_tiny(tmp_path / "other.gguf", model_seed + 61)
    yarn = {"rope_type": "yarn", "factor": 2.0}
    for llm in (
        ob.LLM(other, max_model_len=256),
        ob.LLM(model, max_model_len=256, kv_cache_dtype="f32"),
        ob.LLM(model, max_model_len=256, rope_scaling=yarn),
        ob.LLM(model, max_model_len=256, rope_theta=12345.0),
    ):
        with pytest.raises(ValueError, match="written by another model or with other settings"):
            llm.load_prefix_cache(tmp_path / "c.bin")
        assert llm.cache_stats()["cached_blocks"] == 0


def corrupted(path: Path, out: Path, at: int, value: bytes) -> Path:
    data = bytearray(path.read_bytes())
    data[at : at + len(value)] = value
    out.write_bytes(bytes(data))
    return out


def test_broken_files_are_refused_before_anything_unverified_is_cached(
    model: Path, tmp_path: Path, rng
) -> None:
    good = tmp_path / "c.bin"
    writer = saved(model, good, shared_prompts(rng))
    n, size = writer.cache_stats()["cached_blocks"], good.stat().st_size
    block_bytes = (size - 36 - n * 80) // n  # header 36, 80-byte records, no salts
    data_at = 36 + 80 * n

    def edit(at: int, value: bytes) -> bytes:
        return corrupted(good, tmp_path / "edited", at, value).read_bytes()

    cases = {
        "truncated": (good.read_bytes()[: int(rng.integers(1, size))], "truncated"),
        "magic": (edit(0, b"GGUF"), "not an oxibonsai prefix-cache"),
        "version": (edit(8, b"\x07"), "version 7"),
        "count": (edit(28, b"\xff\xff\xff"), "more than its"),
        "parent": (edit(36 + 80 * (n - 1), n.to_bytes(4, "little")), "does not come before it"),
        "token": (edit(36 + 8, b"\xff\xff\xff\x7f"), "beyond the vocabulary"),
        "salt": (edit(36 + 4, (1 << 20).to_bytes(4, "little")), "too long"),
        "empty": (b"", "truncated"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        fresh = ob.LLM(model, max_model_len=256)
        with pytest.raises(ValueError, match=message):
            fresh.load_prefix_cache(path)
        assert fresh.cache_stats()["cached_blocks"] == 0, name
    flipped_block = int(rng.integers(0, n))
    at = data_at + flipped_block * block_bytes + int(rng.integers(0, block_bytes))
    bad_kv = corrupted(good, tmp_path / "kv.bin", at, bytes([good.read_bytes()[at] ^ 0x10]))
    fresh = ob.LLM(model, max_model_len=256)
    with pytest.raises(ValueError, match=f"block {flipped_block} fails its checksum"):
        fresh.load_prefix_cache(bad_kv)
    assert fresh.cache_stats()["cached_blocks"] <= flipped_block
    # another id, still in the vocabulary:
    token_at = 36 + 80 * flipped_block + 8 + 4 * int(rng.integers(0, 16))
    other_text = edit(token_at, int(rng.integers(0, 256)).to_bytes(1, "little") + b"\0\0\0")
    renamed = tmp_path / "renamed.bin"
    renamed.write_bytes(other_text)
    if other_text != good.read_bytes():
        fresh = ob.LLM(model, max_model_len=256)
        with pytest.raises(ValueError, match=f"block {flipped_block} fails its checksum"):
            fresh.load_prefix_cache(renamed)


def test_missing_files_and_a_cache_that_is_off(model: Path, tmp_path: Path) -> None:
    llm = ob.LLM(model, max_model_len=256)
    with pytest.raises(FileNotFoundError):
        llm.load_prefix_cache(tmp_path / "none.bin")
    with pytest.raises(FileNotFoundError):
        llm.save_prefix_cache(tmp_path / "no-dir" / "c.bin")
    assert llm.save_prefix_cache(tmp_path / "empty.bin") == 0
    assert llm.load_prefix_cache(tmp_path / "empty.bin") == 0
    assert [p.name for p in tmp_path.iterdir()] == ["empty.bin"]  # no partial file left behind
    off = ob.LLM(model, max_model_len=256, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching is off"):
        off.load_prefix_cache(tmp_path / "empty.bin")


def test_async_engines_save_and_load_between_steps(model: Path, tmp_path: Path, rng) -> None:
    prompts = shared_prompts(rng, 3)
    path = tmp_path / "c.bin"

    async def run() -> tuple[list[list[int]], list[int]]:
        async with ob.AsyncLLM(model, max_model_len=256) as first:
            for p in prompts:
                async for _ in first.generate(p, GREEDY):
                    pass
            first.save_prefix_cache(path)
        async with ob.AsyncLLM(model, max_model_len=256) as second:
            assert second.load_prefix_cache(path) > 0
            finals = []
            for p in prompts:
                finals.append([out async for out in second.generate(p, GREEDY)][-1])
            return tokens(finals), [o.num_cached_tokens for o in finals]

    got, cached = asyncio.run(run())
    uncached = ob.LLM(model, max_model_len=256, enable_prefix_caching=False)
    assert got == tokens(uncached.generate(prompts, GREEDY))
    assert all(c > 0 for c in cached)
    assert os.path.exists(path)


def test_the_server_keeps_its_prefix_cache_across_a_restart(model: Path, tmp_path: Path, rng, caplog) -> None:
    """``--prefix-cache-file``: the first server saves at shutdown, the second loads at startup and
    serves the same prompt from cache; a file for another model is logged and skipped."""
    import httpx
    import uvicorn

    from oxibonsai.server import ServerConfig, build_app

    from server_support import threaded_server, wait_until

    path, prompt = tmp_path / "server.bin", shared_prompts(rng, 1)[0]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}

    def serve_once(model_file: Path) -> dict:
        built: list[ob.AsyncLLM] = []

        def factory() -> ob.AsyncLLM:
            built.append(ob.AsyncLLM(model_file, max_model_len=256))
            return built[0]

        app = build_app(factory, ServerConfig(served_model_name="m", prefix_cache_file=str(path)))
        with threaded_server(app, uvicorn.Server, lifespan="on") as (url, _):
            assert wait_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200)
            answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        return answer

    first = serve_once(model)
    assert path.exists() and first["usage"].get("prompt_tokens_details") in (None, {"cached_tokens": 0})
    second = serve_once(model)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * ((len(prompt) - 1) // 16)
    other = write_tiny(tmp_path / "other.gguf", 5)
    with caplog.at_level("WARNING", logger="oxibonsai.server"):
        serve_once(other)
    assert "the prefix-cache file was not loaded" in caplog.text

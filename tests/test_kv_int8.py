"""The int8 KV cache (``kv_cache_dtype="int8"``, the native runner): each token's keys and values of
one KV head stored as integers over one f32 scale (``absmax / 127``).

Tolerances (measured by ``benches/kv_dtype_accuracy.py``): on the random tiny models an int8 cache
moves logits by up to ~0.35 from the float64 reference (f16: ~0.009; 12 models, 60 tokens each), so
the test allows 1.0, as for the int8 matmul kernels, and checks top-1 only where the reference's
top-2 gap exceeds 1.0. On the trained embedded model it costs no measurable quality: bits per byte
on held-out text (110 windows of 512) 1.444361 against f32's 1.444370; the test allows 0.1% on a
random 24 of the windows. Whatever the rounding, an int8 run is deterministic: incremental decode
equals a full recomputation bit for bit, cached prefixes give the uncached tokens, and a
prefix-cache file round-trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import oxibonsai as ob

from heldout import bits_per_byte, heldout_stream
from qwen3_reference import ReferenceQwen3

GREEDY = ob.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["tied", "untied"])
def model(request: pytest.FixtureRequest, tiny_model: Path, tiny_untied_model: Path) -> Path:
    return tiny_model if request.param == "tied" else tiny_untied_model


def random_ids(rng: np.random.Generator, n: int, vocab: int = 300) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def test_int8_kv_logits_stay_within_its_rounding_of_the_reference(model: Path, rng) -> None:
    reference = ReferenceQwen3.from_gguf(model)
    llm = ob.LLM(model, kernel="reference", kv_cache_dtype="int8")
    assert llm.config["kv_cache_dtype"] == "int8"
    ids = random_ids(rng, int(rng.integers(20, 70)), llm.config["vocab"])
    ours, theirs = llm.logits(ids), reference.logits(ids)
    assert 0 < np.abs(ours - theirs).max() < 1.0
    part = np.sort(theirs, axis=1)
    clear = part[:, -1] - part[:, -2] > 1.0
    assert (ours.argmax(1) == theirs.argmax(1))[clear].all()


def test_incremental_decode_equals_full_recomputation_bit_for_bit(model: Path, rng) -> None:
    llm = ob.LLM(model, kv_cache_dtype="int8")
    prompt = random_ids(rng, int(rng.integers(1, 60)))
    out = llm.generate([prompt], ob.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    token_ids = out[0].outputs[0].token_ids
    full = llm.logits(prompt + token_ids)
    assert token_ids == [int(t) for t in full[len(prompt) - 1 : -1].argmax(1)]


def test_cached_prefixes_give_the_uncached_tokens(model: Path, rng) -> None:
    system = random_ids(rng, int(rng.integers(33, 90)))
    prompts = [system + random_ids(rng, int(rng.integers(1, 30))) for _ in range(4)]
    cached = ob.LLM(model, kv_cache_dtype="int8", max_num_seqs=4)
    uncached = ob.LLM(model, kv_cache_dtype="int8", max_num_seqs=4, enable_prefix_caching=False)
    first = [o.outputs[0].token_ids for o in cached.generate(prompts, GREEDY)]
    again = cached.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens >= 32 for o in again)
    want = [o.outputs[0].token_ids for o in uncached.generate(prompts, GREEDY)]
    assert first == want == [o.outputs[0].token_ids for o in again]


def test_a_byte_budget_holds_nearly_twice_the_f16_blocks(model: Path) -> None:
    half = ob.LLM(model, kv_cache_dtype="f16", max_num_seqs=64, kv_cache_bytes=4 << 20).cache_stats()
    int8 = ob.LLM(model, kv_cache_dtype="int8", max_num_seqs=64, kv_cache_bytes=4 << 20).cache_stats()
    config = ob.LLM(model).config
    layers, heads, d = config["n_layers"], config["n_kv_heads"], config["head_dim"]
    # Per layer and KV head: 16 keys and 16 values of `d` bytes each, and their 32 f32 scales.
    block_bytes = layers * heads * (2 * 16 * d + 32 * 4)
    assert int8["capacity_bytes"] == int8["capacity_blocks"] * block_bytes
    assert half["capacity_bytes"] == half["capacity_blocks"] * layers * heads * 2 * 16 * d * 2
    assert int8["capacity_blocks"] == (4 << 20) // block_bytes
    assert int8["capacity_blocks"] > 1.8 * half["capacity_blocks"]


def test_a_prefix_cache_file_round_trips_and_stays_apart_from_f16(model: Path, tmp_path: Path, rng) -> None:
    prompts = [random_ids(rng, 70) + random_ids(rng, int(rng.integers(1, 20))) for _ in range(2)]
    writer = ob.LLM(model, kv_cache_dtype="int8", max_model_len=256)
    want = [o.outputs[0].token_ids for o in writer.generate(prompts, GREEDY)]
    assert writer.save_prefix_cache(tmp_path / "int8.bin") == writer.cache_stats()["cached_blocks"] > 0
    reader = ob.LLM(model, kv_cache_dtype="int8", max_model_len=256)
    assert reader.load_prefix_cache(tmp_path / "int8.bin") == writer.cache_stats()["cached_blocks"]
    outs = reader.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens > 0 for o in outs)
    with pytest.raises(ValueError):
        ob.LLM(model, kv_cache_dtype="f16", max_model_len=256).load_prefix_cache(tmp_path / "int8.bin")


def test_an_unknown_kv_cache_dtype_is_refused_by_name(model: Path) -> None:
    with pytest.raises(ValueError, match="int8"):
        ob.LLM(model, kv_cache_dtype="int4")


def test_bits_per_byte_of_the_embedded_model_stay_those_of_an_exact_cache() -> None:
    exact, int8 = ob.LLM(kv_cache_dtype="f32"), ob.LLM(kv_cache_dtype="int8")
    window = int(exact.metadata["oxibonsai.eval.window_tokens"])
    stream = heldout_stream(exact)
    offset = np.random.default_rng().integers(0, len(stream) - 24 * window - 1)
    sample = stream[offset:]
    want, got = bits_per_byte(exact, sample, window, 24), bits_per_byte(int8, sample, window, 24)
    assert got == pytest.approx(want, rel=0.001)


def test_the_command_line_takes_an_int8_cache(model: Path) -> None:
    params = ob.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = ob.LLM(model, kv_cache_dtype="int8").generate(["the model"], params)[0].outputs[0].text
    args = ["generate", "the model", "--model", str(model), "--kv-cache-dtype", "int8"]
    args += ["--max-tokens", "6", "--temperature", "0", "--ignore-eos"]
    cli = [sys.executable, "-m", "oxibonsai.cli", *args]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"

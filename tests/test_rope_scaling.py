"""Rope scaling (YaRN and linear; ``oxibonsai.RopeScaling``, the ``qwen3.rope.scaling.*`` GGUF keys):
the Rust core's frequencies against the float64 numpy reference (``tests/qwen3_reference.py``, written
from Hugging Face's ``_compute_yarn_parameters``), the native forward pass of a YaRN model against the
reference at positions past the original context, overrides against files that carry the same
scaling, and every kind of bad input.

Bounds: frequencies are float64 on both sides, computed in a different order: 1e-12 relative. Logits
with ``kernel="reference"`` and an f32 KV cache: 1e-3 (``tests/test_model.py``'s exact bound). A
scaling given as an override and the same scaling read from the file run the same arithmetic: equal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai import _core
from oxibonsai.cli import _parser
from oxibonsai.server.cli_args import engine_args

from models import tiny_config, write_tiny
from qwen3_reference import ReferenceQwen3, rope_inv_freq

EXACT = {"kernel": "reference", "kv_cache_dtype": "f32"}
S = gguf.GGUFValueType.STRING
F = gguf.GGUFValueType.FLOAT32
U = gguf.GGUFValueType.UINT32
ORIGINAL = 64  # the tiny YaRN model's trained context; its file says 64, YaRN x4 reaches 256
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


def yarn_keys(factor: float = 4.0, original: int = ORIGINAL, **extra: Any) -> dict[str, Any]:
    keys = {
        "qwen3.rope.scaling.type": ("yarn", S),
        "qwen3.rope.scaling.factor": (factor, F),
        "qwen3.rope.scaling.original_context_length": (original, U),
    }
    return keys | {f"qwen3.rope.scaling.{k}": v for k, v in extra.items()}


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    cfg = tiny_config(context_length=ORIGINAL)
    return write_tiny(tmp_path_factory.mktemp("rope") / "plain.gguf", model_seed + 40, cfg=cfg)


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    """The plain model's weights with YaRN keys (same seed, same tensors)."""
    cfg = tiny_config(context_length=ORIGINAL)
    path = tmp_path_factory.mktemp("rope") / "yarn.gguf"
    return write_tiny(path, model_seed + 40, cfg=cfg, extra_metadata=yarn_keys())


def random_yarn(rng: np.random.Generator) -> dict[str, Any]:
    beta_slow = float(rng.uniform(0.5, 2.0))
    return {
        "rope_type": "yarn",
        "factor": float(rng.choice([1.0, 2.0, 4.0, rng.uniform(1.0, 40.0)])),
        "original_max_position_embeddings": int(rng.choice([64, 4096, 32768, rng.integers(16, 1 << 20)])),
        "beta_fast": beta_slow + float(rng.uniform(1.0, 64.0)),
        "beta_slow": beta_slow,
    }


def test_native_frequencies_match_the_reference(rng: np.random.Generator) -> None:
    for _ in range(40):
        head_dim = int(rng.choice([16, 64, 128, 256]))
        base = float(rng.choice([1e4, 1e6, rng.uniform(100.0, 1e7)]))
        scaling = random_yarn(rng) if rng.random() < 0.7 else {"rope_type": "linear", "factor": 2.5}
        ours, attention = _core.rope_frequencies(head_dim, base, ob.RopeScaling.parse(scaling))
        want, want_attention = rope_inv_freq(head_dim, base, scaling)
        np.testing.assert_allclose(ours, want, rtol=1e-12, atol=0)
        assert attention == pytest.approx(want_attention, rel=1e-12)
    plain, one = _core.rope_frequencies(128, 1e6)
    np.testing.assert_allclose(plain, rope_inv_freq(128, 1e6)[0], rtol=1e-12)
    assert one == 1.0


def test_yarn_model_matches_the_reference_past_its_original_context(yarn_model: Path, rng) -> None:
    llm = ob.LLM(yarn_model, max_model_len=4 * ORIGINAL, **EXACT)
    assert llm.config["rope_scaling"]["rope_type"] == "yarn"
    assert llm.config["max_positions"] == 4 * ORIGINAL
    ids = [
        int(t) for t in rng.integers(0, llm.config["vocab"], int(rng.integers(ORIGINAL + 1, 4 * ORIGINAL)))
    ]
    reference = ReferenceQwen3.from_gguf(yarn_model)
    assert reference.hp.rope_scaling is not None
    np.testing.assert_allclose(llm.logits(ids), reference.logits(ids), atol=1e-3, rtol=0)


def test_an_override_equals_the_same_scaling_in_the_file(plain_model: Path, yarn_model: Path, rng) -> None:
    ids = [int(t) for t in rng.integers(0, 300, 3 * ORIGINAL)]
    from_file = ob.LLM(yarn_model, max_model_len=4 * ORIGINAL, **EXACT).logits(ids)
    overridden = ob.LLM(plain_model, max_model_len=4 * ORIGINAL, rope_scaling=YARN, **EXACT)
    np.testing.assert_array_equal(overridden.logits(ids), from_file)
    as_json = ob.LLM(plain_model, max_model_len=4 * ORIGINAL, rope_scaling=json.dumps(YARN), **EXACT)
    np.testing.assert_array_equal(as_json.logits(ids), from_file)


def test_default_turns_a_files_scaling_off(plain_model: Path, yarn_model: Path, rng) -> None:
    ids = [int(t) for t in rng.integers(0, 300, ORIGINAL)]
    off = ob.LLM(yarn_model, rope_scaling={"rope_type": "default"}, **EXACT)
    assert off.config["rope_scaling"] is None and off.config["max_positions"] == ORIGINAL
    np.testing.assert_array_equal(off.logits(ids), ob.LLM(plain_model, **EXACT).logits(ids))


def test_rope_theta_replaces_the_files_base(tmp_path: Path, plain_model: Path, model_seed: int, rng) -> None:
    cfg = tiny_config(context_length=ORIGINAL, rope_base=5e4)
    other_base = write_tiny(tmp_path / "base.gguf", model_seed + 40, cfg=cfg)
    ids = [int(t) for t in rng.integers(0, 300, 40)]
    theirs = ob.LLM(other_base, **EXACT).logits(ids)
    np.testing.assert_array_equal(ob.LLM(plain_model, rope_theta=5e4, **EXACT).logits(ids), theirs)


def test_linear_scaling_and_the_legacy_key(tmp_path: Path, model_seed: int, rng) -> None:
    cfg = tiny_config(context_length=ORIGINAL)
    keyed = {"qwen3.rope.scaling.type": ("linear", S), "qwen3.rope.scaling.factor": (2.0, F)}
    linear = write_tiny(tmp_path / "linear.gguf", model_seed + 41, cfg=cfg, extra_metadata=keyed)
    legacy = write_tiny(
        tmp_path / "legacy.gguf",
        model_seed + 41,
        cfg=cfg,
        extra_metadata={"qwen3.rope.scale_linear": (2.0, F)},
    )
    ids = [int(t) for t in rng.integers(0, 300, int(rng.integers(ORIGINAL, 2 * ORIGINAL)))]
    llm = ob.LLM(linear, max_model_len=2 * ORIGINAL, **EXACT)
    assert llm.config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    np.testing.assert_allclose(
        llm.logits(ids), ReferenceQwen3.from_gguf(linear).logits(ids), atol=1e-3, rtol=0
    )
    np.testing.assert_array_equal(
        ob.LLM(legacy, max_model_len=2 * ORIGINAL, **EXACT).logits(ids), llm.logits(ids)
    )


def test_max_model_len_stops_at_the_scaled_context(plain_model: Path, yarn_model: Path) -> None:
    with pytest.raises(ValueError, match=r"1..=256 \(the model's context length, with its rope scaling\)"):
        ob.LLM(yarn_model, max_model_len=4 * ORIGINAL + 1)
    with pytest.raises(ValueError, match=r"1..=64 \(the model's context length\)"):
        ob.LLM(plain_model, max_model_len=ORIGINAL + 1)
    assert ob.LLM(yarn_model).max_model_len == 4 * ORIGINAL  # the default: all of it, up to 4096


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' is not supported"),
        ({"factor": 2.0}, "needs a 'rope_type'"),
        ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0}, "keys not supported: mscale"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": False}, "keys not supported: truncate"),
        ({"type": "yarn", "rope_type": "linear", "factor": 2.0}, "both 'type' and 'rope_type'"),
        ({"rope_type": "yarn", "factor": 0.5}, "factor is out of range"),
        ({"rope_type": "yarn", "factor": float("nan")}, "factor is out of range"),
        (
            {"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 2.0},
            "beta_fast is out of range",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
            "original_max_position",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1.5},
            "original_max_position",
        ),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}, "attention_factor is out of range"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a dict"),
    ],
)
def test_bad_overrides_are_value_errors(plain_model: Path, scaling: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ob.LLM(plain_model, rope_scaling=scaling)


@pytest.mark.parametrize("theta", [0.5, float("inf"), True, "big"])
def test_bad_rope_theta_is_a_value_error(plain_model: Path, theta: Any) -> None:
    with pytest.raises(ValueError, match="rope_theta"):
        ob.LLM(plain_model, rope_theta=theta)


def test_the_old_type_key_and_attention_factor_are_accepted(plain_model: Path) -> None:
    llm = ob.LLM(plain_model, rope_scaling={"type": "yarn", "factor": 2.0, "attention_factor": 1.5})
    assert llm.config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 1.5,
    }


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"qwen3.rope.scaling.type": ("longrope", S)}, '"longrope" is not supported'),
        ({"qwen3.rope.scaling.type": ("yarn", S)}, "rope.scaling.factor is required"),
        (yarn_keys(factor=0.5), "rope.scaling.factor is out of range"),
        (yarn_keys(original=0), "original_context_length is out of range"),
        (yarn_keys(yarn_beta_fast=(0.5, F)), "yarn_beta_fast is out of range"),
        (yarn_keys(yarn_ext_factor=(0.5, F)), "yarn_ext_factor = 0.5 is not supported"),
        (yarn_keys(yarn_log_multiplier=(0.1, F)), "yarn_log_multiplier"),
        ({"qwen3.rope.scaling.type": (3, U)}, "rope.scaling.type"),
    ],
)
def test_bad_scaling_keys_are_gguf_errors(tmp_path: Path, model_seed: int, keys: dict, message: str) -> None:
    path = write_tiny(
        tmp_path / "bad.gguf", model_seed, cfg=tiny_config(context_length=ORIGINAL), extra_metadata=keys
    )
    with pytest.raises(ob.GGUFError, match=message):
        ob.LLM(path)


def test_neutral_values_of_unimplemented_keys_load(
    tmp_path: Path, model_seed: int, yarn_model: Path, rng
) -> None:
    neutral = yarn_keys(yarn_ext_factor=(1.0, F), attn_factor=(1.0, F), yarn_attn_factor=(1.0, F))
    path = write_tiny(
        tmp_path / "neutral.gguf",
        model_seed + 40,
        cfg=tiny_config(context_length=ORIGINAL),
        extra_metadata=neutral,
    )
    ids = [int(t) for t in rng.integers(0, 300, 2 * ORIGINAL)]
    same = ob.LLM(path, max_model_len=256, **EXACT).logits(ids)
    np.testing.assert_array_equal(same, ob.LLM(yarn_model, max_model_len=256, **EXACT).logits(ids))


def test_generation_with_yarn_is_cached_and_uncached_alike(yarn_model: Path, rng) -> None:
    prompt = [int(t) for t in rng.integers(0, 300, ORIGINAL + 20)]
    params = ob.SamplingParams(max_tokens=int(rng.integers(20, 60)), temperature=0.0, ignore_eos=True)
    uncached = ob.LLM(yarn_model, max_model_len=256, enable_prefix_caching=False)
    cached = ob.LLM(yarn_model, max_model_len=256)
    want = uncached.generate([prompt], params)[0].outputs[0].token_ids
    cached.generate([prompt], params)
    again = cached.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want


def test_the_command_line_takes_vllms_rope_flags(plain_model: Path) -> None:
    params = ob.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm = ob.LLM(plain_model, max_model_len=256, rope_scaling=YARN, rope_theta=2e6)
    expected = llm.generate(["the model " * 30], params)[0].outputs[0].text
    flags = ["--model", str(plain_model), "--max-model-len", "256", "--rope-scaling", json.dumps(YARN)]
    flags += ["--rope-theta", "2e6", "--max-tokens", "5", "--temperature", "0", "--ignore-eos"]
    done = run_cli("generate", "the model " * 30, *flags)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    bad = run_cli("generate", "hi", "--model", str(plain_model), "--rope-scaling", '{"rope_type": "dynamic"}')
    assert bad.returncode == 2 and "--rope-scaling: rope_type 'dynamic' is not supported" in bad.stderr
    args = _parser().parse_args(["serve", "--rope-scaling", json.dumps(YARN), "--rope-theta", "5e5"])
    engine = engine_args(args)
    assert engine["rope_scaling"] == ob.RopeScaling(**YARN) and engine["rope_theta"] == 5e5


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "oxibonsai.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)

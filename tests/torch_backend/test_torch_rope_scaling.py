"""Rope scaling on the torch path (CPU, plain-torch ops): a YaRN model's logits against the float64
reference past its original context, the torch runner's overrides against the file's scaling, the
config it reports, and ``rope_neox`` with a scaling against the reference's rotation. The cases and
files are ``tests/test_rope_scaling.py``'s.

Bounds: ``tests/torch_backend/test_torch_model.py``'s (every logit within 1e-3 of the reference; a
median relative L2 error under 1e-5); overrides and files run the same arithmetic: equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from test_rope_scaling import ORIGINAL, YARN, yarn_keys  # noqa: E402

import oxibonsai as ob  # noqa: E402
from oxibonsai.torch_backend.batch import StepBatch  # noqa: E402
from oxibonsai.torch_backend.model import TorchQwen3  # noqa: E402
from oxibonsai.torch_backend.ops import ref_torch  # noqa: E402

import qwen3_reference  # noqa: E402
from models import tiny_config, write_tiny  # noqa: E402

LOGIT_ATOL = 1e-3
MEDIAN_REL_L2 = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> tuple[Path, Path]:
    """(plain, yarn): the same weights, with and without YaRN keys."""
    cfg, folder = tiny_config(context_length=ORIGINAL), tmp_path_factory.mktemp("torch-rope")
    plain = write_tiny(folder / "plain.gguf", model_seed + 50, cfg=cfg)
    return plain, write_tiny(folder / "yarn.gguf", model_seed + 50, cfg=cfg, extra_metadata=yarn_keys())


def forward(model: TorchQwen3, ids: list[int]) -> np.ndarray:
    blocks = list(range(-(-len(ids) // 16)))
    kv = model.new_kv_pool(len(blocks))
    return model.forward(StepBatch.for_sequences([(blocks, 0, ids, True)]).to_device("cpu"), kv).numpy()


def test_yarn_logits_match_the_reference_past_the_original_context(models, rng) -> None:
    _, yarn = models
    model = TorchQwen3.from_gguf(yarn, "cpu", ref_torch)
    assert model.config.max_positions == 4 * ORIGINAL and model.cos_sin.shape[0] == 4 * ORIGINAL
    ids = [int(t) for t in rng.integers(0, model.config.vocab, int(rng.integers(ORIGINAL + 1, 4 * ORIGINAL)))]
    ours, theirs = forward(model, ids), qwen3_reference.ReferenceQwen3.from_gguf(yarn).logits64(ids)
    rel = np.linalg.norm(ours - theirs, axis=1) / np.linalg.norm(theirs, axis=1)
    assert np.median(rel) < MEDIAN_REL_L2 and np.abs(ours - theirs).max() < LOGIT_ATOL


def test_the_torch_runner_takes_overrides_like_the_native_one(models, rng) -> None:
    plain, yarn = models
    ids = [int(t) for t in rng.integers(0, 300, 3 * ORIGINAL)]
    kw = {"device": "cpu", "runner": "torch", "max_model_len": 4 * ORIGINAL, "kv_cache_dtype": "f32"}
    from_file = ob.LLM(yarn, **kw)
    overridden = ob.LLM(plain, rope_scaling=YARN, **kw)
    assert overridden.config["rope_scaling"] == from_file.config["rope_scaling"]
    assert from_file.config["rope_scaling"] == ob.LLM(yarn, kernel="reference").config["rope_scaling"]
    np.testing.assert_array_equal(overridden.logits(ids), from_file.logits(ids))
    native = ob.LLM(yarn, max_model_len=4 * ORIGINAL, kernel="reference", kv_cache_dtype="f32")
    assert np.abs(from_file.logits(ids) - native.logits(ids)).max() < LOGIT_ATOL
    off = ob.LLM(yarn, rope_scaling={"rope_type": "default"}, rope_theta=2e6, device="cpu", runner="torch")
    assert off.config["rope_scaling"] is None and off.config["rope_base"] == 2e6
    with pytest.raises(ValueError, match="with its rope scaling"):
        ob.LLM(yarn, max_model_len=4 * ORIGINAL + 1, device="cpu", runner="torch")


def test_rope_neox_with_yarn_matches_the_reference(rng) -> None:
    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
    x = rng.standard_normal((9, 3, 128))
    positions = rng.integers(0, 8 * 4096, size=9)
    out = ref_torch.rope_neox(
        torch.from_numpy(x.astype(np.float32)),
        torch.from_numpy(positions),
        1e6,
        ob.RopeScaling.parse(scaling).resolved(4096),
    )
    cos, sin = qwen3_reference.rope_tables(positions, 128, 1e6, scaling)
    want = qwen3_reference.rope_neox(x.transpose(1, 0, 2), cos, sin).transpose(1, 0, 2)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-5)

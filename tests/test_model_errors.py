"""Bad models and bad requests: each is a clear exception, and the LLM stays usable afterwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import oxibonsai as ob

from models import tiny_config, write_tiny

GREEDY = ob.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        ob.LLM(tmp_path / "nope.gguf")


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am not a model\n" * 10)
    with pytest.raises(ob.GGUFError):
        ob.LLM(path)


def test_truncated_files_fail_cleanly_at_every_cut(tiny_model, tmp_path, rng):
    data = tiny_model.read_bytes()
    cuts = sorted({0, 3, 4, 8, 23, 24, *rng.integers(25, len(data) - 1, 40).tolist(), len(data) - 1})
    for cut in cuts:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ob.GGUFError):
            ob.LLM(path)
        path.unlink()


def test_wrong_architecture(tmp_path, model_seed):
    path = write_tiny(tmp_path / "llama.gguf", model_seed, extra_metadata={"general.architecture": "llama"})
    with pytest.raises(ob.GGUFError, match="architecture"):
        ob.LLM(path)


def test_mismatched_tensor_shape_names_the_tensor(tmp_path, model_seed):
    cfg = tiny_config()
    bad = {"blk.1.attn_k.weight": (cfg.kv_size + 128, cfg.hidden_size)}
    path = write_tiny(tmp_path / "shape.gguf", model_seed, override_shapes=bad)
    with pytest.raises(ob.GGUFError, match=r"blk\.1\.attn_k\.weight"):
        ob.LLM(path)


def test_missing_tensor_names_the_tensor(tmp_path, model_seed):
    path = write_tiny(tmp_path / "missing.gguf", model_seed, omit_tensors=["blk.0.ffn_up.weight"])
    with pytest.raises(ob.GGUFError, match=r"blk\.0\.ffn_up\.weight"):
        ob.LLM(path)


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> ob.LLM:
    return ob.LLM(tiny_model, max_model_len=64)


def still_works(llm: ob.LLM) -> None:
    out = llm.generate("the model", GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert llm._runner._model.num_free_blocks == llm._runner._model.num_blocks


def test_prompt_longer_than_the_context(llm, rng):
    ids = [int(t) for t in rng.integers(0, 500, 80)]
    with pytest.raises(ValueError, match=r"80 tokens.*max_model_len=64"):
        llm.generate([ids], GREEDY)
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.logits(ids)
    still_works(llm)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(TypeError):
        llm.generate([[1.5, "x"]], GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"text": "hi"}, GREEDY)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [GREEDY])
    still_works(llm)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": -5},
        {"min_p": 1.5},
        {"max_tokens": 0},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 3.0},
        {"logprobs": -1},
        {"temperature": float("nan")},
    ],
)
def test_invalid_sampling_parameters(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        ob.SamplingParams(**kwargs)


def test_an_error_mid_batch_frees_everything(llm, rng):
    ok = [int(t) for t in rng.integers(0, 500, 5)]
    with pytest.raises(ValueError):
        llm.generate([ok, [int(t) for t in rng.integers(0, 500, 200)]], GREEDY)
    still_works(llm)


def test_kv_cache_too_small_for_a_request(tiny_model):
    small = ob.LLM(tiny_model, max_model_len=128, kv_cache_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate("the model", ob.SamplingParams(max_tokens=100))
    out = small.generate("the model", GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_nan_weights_are_rejected_at_load(tmp_path, tiny_model):
    data = bytearray(tiny_model.read_bytes())
    f = ob.GGUFFile(tiny_model)
    info = f.tensor_info("output_norm.weight")
    del f
    data[info["offset"] : info["offset"] + 4] = np.float32("nan").tobytes()
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ob.GGUFError, match="output_norm"):
        ob.LLM(path)

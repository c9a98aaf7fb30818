"""A model's recommended sampling (the GGUF's ``general.sampling.*`` keys, as llama.cpp's converter
writes them): read and checked; the fields a caller leaves out take them in ``LLM.generate`` without
parameters, in the server's requests and in the CLI's flags; ``generation_config="vllm"`` ignores
them; a bad value is skipped with a warning, never a failed load."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest

import oxibonsai as ob
from oxibonsai.generation_config import model_sampling_defaults

from models import write_tiny

F32 = gguf.GGUFValueType.FLOAT32
U32 = gguf.GGUFValueType.UINT32


def recommended(rng: random.Random) -> dict[str, Any]:
    """Random recommended fields with a temperature of 0, so their outputs are greedy's."""
    return {
        "temperature": 0.0,
        "top_k": rng.randrange(2, 60),
        "top_p": rng.choice([0.8, 0.9, 0.95]),
        "min_p": rng.choice([0.0, 0.05]),
        "repetition_penalty": rng.choice([1.05, 1.1, 1.3]),
    }


def gguf_keys(fields: dict[str, Any]) -> dict[str, Any]:
    keys = {"temperature": "temp", "repetition_penalty": "penalty_repeat"}
    return {
        f"general.sampling.{keys.get(name, name)}": (value, U32 if name == "top_k" else F32)
        for name, value in fields.items()
    }


@pytest.fixture(scope="module")
def fields() -> dict[str, Any]:
    return recommended(random.Random())


@pytest.fixture(scope="module")
def hinted_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int, fields: dict[str, Any]) -> Path:
    path = tmp_path_factory.mktemp("hinted") / "m.gguf"
    return write_tiny(path, model_seed, extra_metadata=gguf_keys(fields))


def test_the_keys_map_to_fields_with_float32_rounding_undone(fields):
    metadata = {k: float(v) if t == F32 else v for k, (v, t) in gguf_keys(fields).items()}
    metadata["general.sampling.top_p"] = 0.949999988079071  # 0.95 as a float32 reads back
    metadata["general.sampling.mirostat"] = 2  # not a field here: not read
    got = model_sampling_defaults(metadata)
    assert got == {**fields, "top_p": 0.95}
    assert isinstance(got["top_k"], int)
    assert model_sampling_defaults(metadata, "vllm") == {}
    assert model_sampling_defaults({}) == {}
    with pytest.raises(ValueError, match="generation_config"):
        model_sampling_defaults(metadata, "hf")


@pytest.mark.parametrize(
    "key, value",
    [
        ("general.sampling.top_p", 5.0),
        ("general.sampling.temp", -1.0),
        ("general.sampling.temp", "hot"),
        ("general.sampling.top_k", 2.5),
        ("general.sampling.min_p", True),
    ],
)
def test_a_bad_value_is_skipped_with_a_warning(key, value):
    with pytest.warns(UserWarning, match=key):
        got = model_sampling_defaults({key: value, "general.sampling.repetition_penalty": 1.2})
    assert got == {}


def test_calls_without_parameters_sample_as_the_model_recommends(hinted_model, fields, rng):
    llm = ob.LLM(hinted_model)
    assert llm.default_sampling_fields == {**fields}
    defaults = llm.get_default_sampling_params()
    for name, value in fields.items():
        assert getattr(defaults, name) == value
    prompt = [int(t) for t in rng.integers(0, 800, 12)]
    explicit = ob.SamplingParams(**fields)  # max_tokens 16, as the defaults'
    want = llm.generate([prompt], explicit)[0].outputs[0].token_ids
    assert llm.generate([prompt])[0].outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in llm.stream(prompt)][-1] == want

    plain = ob.LLM(hinted_model, generation_config="vllm")
    assert plain.default_sampling_fields == {}
    assert plain.get_default_sampling_params().temperature == ob.SamplingParams().temperature
    given = ob.SamplingParams(temperature=1.0, seed=rng.integers(2**32))  # not merged with the model's
    assert [llm.generate([prompt], given)[0].outputs[0].token_ids] == [
        plain.generate([prompt], given)[0].outputs[0].token_ids
    ]


def test_server_requests_take_the_models_fields_they_leave_out(hinted_model, fields):
    from oxibonsai.server.protocol import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=3)
    params = chat.sampling_params(16, None, None, fields)
    assert params.top_k == 3 and params.temperature == 0.0 and params.top_p == fields["top_p"]
    completion = CompletionRequest(prompt="hi", temperature=0.5)
    params = completion.sampling_params(16, None, None, fields)
    assert params.temperature == 0.5 and params.repetition_penalty == fields["repetition_penalty"]
    assert CompletionRequest(prompt="hi").sampling_params(16, None, None).temperature == 1.0


def test_the_server_samples_with_the_models_fields(hinted_model, fields):
    pytest.importorskip("fastapi")
    from server_support import app_for, post

    engine = ob.AsyncLLM(hinted_model, kv_cache_blocks=64)
    try:
        app = app_for(engine)
        body = {"prompt": "the model", "max_tokens": 8, "ignore_eos": True}
        texts = []
        for extra in ({}, {}, {**fields}):  # unset twice (greedy, so the same), then given
            r = post(app, "/v1/completions", {**body, **extra})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1] == texts[2]
    finally:
        engine.shutdown()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "oxibonsai.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_the_cli_reports_and_uses_the_models_fields(hinted_model, fields):
    info = cli("info", str(hinted_model))
    assert info.returncode == 0, info.stderr
    assert f"temperature=0.0, top_k={fields['top_k']}, top_p={fields['top_p']}" in info.stdout
    args = ("generate", "the model", "--model", str(hinted_model), "--max-tokens", "6", "--ignore-eos")
    unset = cli(*args)
    assert unset.returncode == 0, unset.stderr
    assert "the model's sampling defaults: temperature=0.0" in unset.stderr
    llm = ob.LLM(hinted_model)
    want = llm.generate(["the model"], ob.SamplingParams(**fields, max_tokens=6, ignore_eos=True))
    assert unset.stdout == want[0].outputs[0].text + "\n"

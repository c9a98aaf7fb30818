"""The embedded default model as a fresh install sees it: ``LLM()`` loads it, the CLI generates with it,
and the Rust engine computes the model that was trained. Bits per byte on held-out text (documents the
training never saw, in ``tests/data/default_model_heldout.txt``), computed here through ``LLM.logits``
exactly as ``scripts/default_model/evaluate.py`` computes them in torch, must equal the training
script's figure stored in the file within 1%, and beat the unigram baseline stored beside it by 40%."""

from __future__ import annotations

import subprocess
import sys

import pytest

import oxibonsai as ob
from oxibonsai.llm import default_model_path

from heldout import bits_per_byte, heldout_stream

MAX_BYTES = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def llm() -> ob.LLM:
    return ob.LLM()


def test_the_package_ships_one_small_bonsai_format_model(llm):
    path = default_model_path()
    assert llm.model_path == path
    assert path.stat().st_size <= MAX_BYTES
    meta = llm.metadata
    assert meta["general.architecture"] == "qwen3"
    assert "PSF" in meta["oxibonsai.training.corpus_license"]
    assert "Python" in meta["oxibonsai.training.corpus"]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    infos = ob.GGUFFile(path).tensors()
    matrices = [t for t in infos if len(t["shape"]) == 2]
    assert matrices and all(t["type"] == "Q1_0" for t in matrices)
    assert all(t["type"] == "F32" for t in infos if len(t["shape"]) == 1)


def test_greedy_continuation_is_words(llm):
    params = ob.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = llm.generate(["The list object"], params)[0].outputs[0].text
    words = text.split()
    assert len(words) >= 8
    assert sum(w.strip(".,;:()'\"").isalpha() for w in words) >= 0.6 * len(words)


def test_cli_generate_uses_the_default_model():
    done = subprocess.run(
        [sys.executable, "-m", "oxibonsai.cli", "generate", "A dictionary is", "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_engine_bits_per_byte_match_training_and_beat_unigram(llm):
    meta = llm.metadata
    window, count = int(meta["oxibonsai.eval.window_tokens"]), int(meta["oxibonsai.eval.windows"])
    stream = heldout_stream(llm)
    assert len(stream) >= window * count + 1
    engine = bits_per_byte(llm, stream, window, count)
    trained = float(meta["oxibonsai.eval.bits_per_byte"])
    unigram = float(meta["oxibonsai.eval.unigram_bits_per_byte"])
    assert engine == pytest.approx(trained, rel=0.01)
    assert engine <= 0.6 * unigram

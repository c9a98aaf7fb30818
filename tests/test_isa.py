"""``OXIBONSAI_ISA``: each instruction set this CPU has can be asked for, and runs the whole model with
the fastest set's results bit for bit: prefill logits and greedy decode tokens, with the f16 KV cache
(the default; each set has its own attention kernel, all doing the same arithmetic), with f32 and with
int8.
Each set runs in its own process, as the choice is read once per process. (Across CPUs and
architectures: ``rust/core/tests/same_bits.rs``.)"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import oxibonsai

AVAILABLE = oxibonsai.kernel_info()["available"]

# Saves the logits of the token ids in argv[3] to argv[2] (KV cache type argv[4]); prints the
# instruction set in use and the greedy continuation of those ids.
CHILD = """
import json, sys
import numpy as np
import oxibonsai
llm = oxibonsai.LLM(sys.argv[1], num_threads=2, kv_cache_dtype=sys.argv[4])
prompt = json.loads(sys.argv[3])
np.save(sys.argv[2], llm.logits(prompt))
greedy = oxibonsai.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
out = llm.generate([prompt], greedy)[0].outputs[0]
print(json.dumps([oxibonsai.kernel_info()["isa"], list(out.token_ids)]))
"""


def run_child(
    isa: str, model: Path, out: Path, tokens: list[int], kv: str = "f16"
) -> tuple[str, list[int], str]:
    """The instruction set the child used, its greedy tokens, and its stderr."""
    env = {**os.environ, "OXIBONSAI_ISA": isa}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(out), json.dumps(tokens), kv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    isa_used, tokens_out = json.loads(done.stdout)
    return isa_used, tokens_out, done.stderr


@pytest.fixture(scope="module", params=["f16", "f32", "int8"])
def fastest(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[int], np.ndarray, list[int]]:
    """A KV cache type, a fresh random prompt, and the fastest set's logits and greedy tokens for it
    (one child)."""
    seed = secrets.randbits(64)
    print(f"prompt seed: {seed}")
    vocab = oxibonsai.LLM(tiny_model).tokenizer.vocab_size
    prompt = np.random.default_rng(seed).integers(0, vocab, 40).tolist()
    out = tmp_path_factory.mktemp("isa") / "fastest.npy"
    isa, tokens, _ = run_child(AVAILABLE[-1], tiny_model, out, prompt, request.param)
    assert isa == AVAILABLE[-1]
    return request.param, prompt, np.load(out), tokens


@pytest.mark.parametrize("isa", AVAILABLE)
def test_each_instruction_set_gives_the_fastest_ones_results(
    isa: str, tiny_model: Path, fastest: tuple[str, list[int], np.ndarray, list[int]], tmp_path: Path
) -> None:
    # For the fastest set itself this checks that a second process gives the same bits.
    kv, prompt, want_logits, want_tokens = fastest
    got_isa, got_tokens, stderr = run_child(isa, tiny_model, tmp_path / "got.npy", prompt, kv)
    assert got_isa == isa
    assert "OXIBONSAI_ISA" not in stderr
    np.testing.assert_array_equal(np.load(tmp_path / "got.npy"), want_logits)
    assert got_tokens == want_tokens


@pytest.mark.parametrize("kind", ["missing", "unknown"])
def test_a_name_the_cpu_lacks_leaves_the_fastest_with_a_warning(
    kind: str, tiny_model: Path, tmp_path: Path
) -> None:
    missing = next(name for name in ("neon", "avx512", "avx2", "scalar") if name not in AVAILABLE)
    name = missing if kind == "missing" else "avx9000"
    isa, _, stderr = run_child(name, tiny_model, tmp_path / "logits.npy", [1, 2, 3])
    assert isa == AVAILABLE[-1]
    assert f"OXIBONSAI_ISA={name!r} is not an instruction set this CPU can run" in stderr

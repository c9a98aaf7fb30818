"""Prompt logprobs on the torch runner (CPU device, with device sampling on and off): the scores equal
a float64 ``log_softmax`` of the runner's own every-position logits, the tokens do not change, and a
chunked, preempted prefill among other requests scores as a lone run."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from test_prompt_logprobs import assert_same_scores, check_scores, expected, random_ids  # noqa: E402

import oxibonsai as ob  # noqa: E402


def torch_llm(path: Path, **kwargs: object) -> ob.LLM:
    args: dict[str, object] = {"device": "cpu", "runner": "torch", "max_model_len": 256, "max_num_seqs": 4}
    return ob.LLM(path, **{**args, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize("device_sampling", ["0", "1"])
def test_torch_prompt_logprobs_match_a_float64_softmax(tiny_model, rng, monkeypatch, device_sampling):
    monkeypatch.setenv("OXIBONSAI_DEVICE_SAMPLING", device_sampling)
    llm = torch_llm(tiny_model, kv_cache_dtype="f32")
    vocab = llm.config["vocab"]
    k = int(rng.integers(0, 4))
    prompts = [random_ids(rng, vocab, int(n)) for n in rng.integers(2, 50, 3)]
    plain = ob.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    scored = ob.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
    for ids, out, alone in zip(
        prompts, llm.generate(prompts, scored), llm.generate(prompts, plain), strict=True
    ):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        check_scores(out, expected(llm, ids, k), k)


def test_torch_chunked_preempted_prefills_score_as_a_lone_run(tiny_model, rng):
    prompts = [random_ids(rng, 300, int(n)) for n in rng.integers(40, 100, 4)]
    params = ob.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    lone = torch_llm(tiny_model, kv_cache_dtype="f32", max_num_seqs=1, enable_prefix_caching=False)
    want = [lone.generate([p], params)[0] for p in prompts]
    blocks = max(-(-(len(p) + 6) // 16) for p in prompts) + 2
    tight = torch_llm(tiny_model, kv_cache_dtype="f32", max_num_batched_tokens=32, kv_cache_blocks=blocks)
    got = tight.generate(prompts, params)
    assert tight._engine.scheduler_stats()["preemptions"] > 0
    for g, w in zip(got, want, strict=True):
        assert_same_scores(g, w, 1e-4)

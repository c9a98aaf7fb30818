"""The engine sampling on the torch runner's device (``TorchRunner.sample_on_device``; forced on the CPU
here with ``OXIBONSAI_DEVICE_SAMPLING=1``): greedy tokens and logprobs as the Rust sampler gives them on
the same logits; a seeded request draws the same tokens run after run, alone or beside other requests
with other parameters; ids banned before ``min_tokens`` are never drawn; NaN logits fail the step with
the Rust sampler's error. (Device draws use their own random stream, so seeded tokens differ from the
host sampler's; ``test_device_sampling.py`` checks that the distributions are the same.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

import oxibonsai as ob  # noqa: E402

ARGS: dict[str, object] = {"device": "cpu", "runner": "torch", "max_model_len": 256, "max_num_seqs": 4}


def torch_llm(path: Path, monkeypatch: pytest.MonkeyPatch, on_device: bool, **kwargs: object) -> ob.LLM:
    monkeypatch.setenv("OXIBONSAI_DEVICE_SAMPLING", "1" if on_device else "0")
    llm = ob.LLM(path, **{**ARGS, "kv_cache_dtype": "f32", **kwargs})  # type: ignore[arg-type]
    assert llm._runner.sample_on_device is on_device  # type: ignore[attr-defined]
    return llm


def prompts(rng: np.random.Generator, vocab: int, count: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, vocab, int(rng.integers(3, 30)))] for _ in range(count)]


def tokens(outs: list[ob.RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_and_logprobs_equal_the_host_samplers(tiny_model, monkeypatch, rng):
    device = torch_llm(tiny_model, monkeypatch, True)
    host = torch_llm(tiny_model, monkeypatch, False)
    ps = prompts(rng, device.config["vocab"], 3)
    params = ob.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    got, want = device.generate(ps, params), host.generate(ps, params)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want, strict=True):
        for step_g, step_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert list(step_g) == list(step_w)  # the same ids, the token's and the top 3
            for t in step_g:
                assert step_g[t].rank == step_w[t].rank
                assert step_g[t].logprob == pytest.approx(step_w[t].logprob, rel=1e-5, abs=1e-5)
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, rel=1e-5)


def test_logit_bias_steers_device_draws_as_host_ones(tiny_model, monkeypatch, rng):
    device = torch_llm(tiny_model, monkeypatch, True)
    host = torch_llm(tiny_model, monkeypatch, False)
    vocab = device.config["vocab"]
    ps = prompts(rng, vocab, 3)
    plain = ob.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = tokens(host.generate(ps, plain))
    bias = {first[0][0]: -100.0, int(rng.integers(vocab)): float(rng.uniform(-5, 5)), first[1][1]: -100.0}
    biased = ob.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=bias)
    got = tokens(device.generate(ps, [biased, biased, plain]))
    assert got == tokens(host.generate(ps, [biased, biased, plain]))
    assert got[0][0] != first[0][0] and got[2] == first[2]


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_any_batch(tiny_model, monkeypatch, rng):
    llm = torch_llm(tiny_model, monkeypatch, True)
    vocab = llm.config["vocab"]
    seed = int(rng.integers(0, 2**63))
    seeded = ob.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
    others = [
        ob.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        ob.SamplingParams(max_tokens=9, temperature=1.3, top_k=20, repetition_penalty=1.2, ignore_eos=True),
        ob.SamplingParams(max_tokens=5, temperature=0.7, min_p=0.1, frequency_penalty=0.5, ignore_eos=True),
    ]
    prompt = prompts(rng, vocab, 1)[0]
    alone = tokens(llm.generate([prompt], seeded))[0]
    assert alone == tokens(llm.generate([prompt], seeded))[0]
    for count in (1, 2, 3):
        batch = [prompt, *prompts(rng, vocab, count)]
        outs = llm.generate(batch, [seeded, *others[:count]])
        assert tokens(outs)[0] == alone, f"beside {count} other request(s)"
    # A new engine on another device pool and cache state: the same tokens again.
    again = torch_llm(tiny_model, monkeypatch, True, enable_prefix_caching=False)
    assert tokens(again.generate([prompt], seeded))[0] == alone
    # An unseeded request follows the engine's seed.
    unseeded = ob.SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    first = torch_llm(tiny_model, monkeypatch, True, seed=5).generate([prompt], unseeded)
    assert tokens(first) == tokens(
        torch_llm(tiny_model, monkeypatch, True, seed=5).generate([prompt], unseeded)
    )


def test_ids_banned_before_min_tokens_are_never_drawn(tiny_model, monkeypatch, rng):
    llm = torch_llm(tiny_model, monkeypatch, True)
    prompt = prompts(rng, llm.config["vocab"], 1)[0]
    greedy = ob.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = tokens(llm.generate([prompt], greedy))[0][0]
    banned = ob.SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=[first], min_tokens=2)
    out = tokens(llm.generate([prompt], banned))[0]
    assert out[0] != first and len(out) >= 2


def test_nan_logits_fail_the_step_with_the_samplers_error(tiny_model, monkeypatch, rng):
    llm = torch_llm(tiny_model, monkeypatch, True)
    model = llm._runner.model  # type: ignore[attr-defined]
    real = model.forward

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        logits = real(*args, **kwargs).clone()
        logits[-1, 7] = float("nan")
        return logits

    monkeypatch.setattr(model, "forward", poisoned)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        llm.generate(prompts(rng, llm.config["vocab"], 2), ob.SamplingParams(max_tokens=2))


def test_penalized_requests_keep_history_rows_until_they_finish(tiny_model, monkeypatch, rng):
    """Penalties read each request's history rows kept on the device (``DeviceHistories``); finished
    and aborted requests give their rows back, and the tokens are those of rows rebuilt every step."""
    llm = torch_llm(tiny_model, monkeypatch, True)
    vocab = llm.config["vocab"]
    params = ob.SamplingParams(
        max_tokens=10, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5, ignore_eos=True
    )
    ps = prompts(rng, vocab, 3)
    kept = tokens(llm.generate(ps, params))
    assert len(llm._runner.histories) == 0  # type: ignore[attr-defined]
    rebuilt = torch_llm(tiny_model, monkeypatch, True)
    monkeypatch.setattr(rebuilt._runner, "histories", None)  # type: ignore[attr-defined]
    assert tokens(rebuilt.generate(ps, params)) == kept


@pytest.mark.parametrize("on_device", [True, False], ids=["device-sampling", "host-sampling"])
def test_overlapped_output_work_gives_the_plain_orders_tokens(tiny_model, monkeypatch, rng, on_device):
    """``OXIBONSAI_ASYNC_OUTPUT=1`` (the default on CUDA) launches each step before the last one's
    output work; the runner's draws then come through ``pending.HostCopy``. Same tokens, logprobs and
    text for a mix with penalties (device history rows), seeds, logprobs and stop ids: the steps are the
    same, so even the float logprobs are."""
    monkeypatch.setenv("OXIBONSAI_ASYNC_OUTPUT", "0")
    plain = torch_llm(tiny_model, monkeypatch, on_device, enable_prefix_caching=False)
    monkeypatch.setenv("OXIBONSAI_ASYNC_OUTPUT", "1")
    overlapped = torch_llm(tiny_model, monkeypatch, on_device, enable_prefix_caching=False)
    assert overlapped._runner.async_output and not plain._runner.async_output  # type: ignore[attr-defined]
    ps = prompts(rng, plain.config["vocab"], 6)
    first = tokens(plain.generate(ps[:1], ob.SamplingParams(max_tokens=4, temperature=0.0)))[0]
    seed = int(rng.integers(0, 2**63))
    params = [
        ob.SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2),
        ob.SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True),
        ob.SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4),
        ob.SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[first[-1]]),
        ob.SamplingParams(max_tokens=5, temperature=1.1, top_k=9, seed=seed + 1, frequency_penalty=0.3),
        ob.SamplingParams(max_tokens=3, temperature=0.0, min_tokens=2, stop_token_ids=[first[0]]),
    ]
    got, want = overlapped.generate(ps, params), plain.generate(ps, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids and g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert len(overlapped._runner.histories) == 0  # type: ignore[attr-defined]

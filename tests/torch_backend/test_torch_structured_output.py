"""Structured output on the torch runner (CPU device). Device sampling under a token mask equals
device sampling with every disallowed id banned (the path ``test_device_sampling`` checks against the
Rust sampler), draw for draw. End to end, with device sampling on and off and with steps launched
ahead and async output on: every token is one the grammar allowed, complete outputs match their
specification, and greedy tokens are the same either way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from test_device_sampling import DEVICE, VOCAB, Rows, random_params, seeds_for  # noqa: E402
from test_structured_output import SPECS, allows, random_text_prompts, satisfies  # noqa: E402

import oxibonsai as ob  # noqa: E402
from oxibonsai.torch_backend.sampling import SamplingBatch, probabilities, sample  # noqa: E402


def random_mask(rng: np.random.Generator, vocab: int, keep: int) -> np.ndarray:
    """An int32 allow-bitmask with a random density that allows ``keep``."""
    allowed = rng.random(vocab) < rng.choice([0.01, 0.3, 0.95])
    allowed[keep] = True
    padded = np.zeros((vocab + 31) // 32 * 32, dtype=bool)
    padded[:vocab] = allowed
    return np.packbits(padded, bitorder="little").view(np.int32)


def test_a_mask_samples_as_banning_every_id_it_leaves_out(rng):
    n = 12
    rows = Rows.random(rng, n)
    params = [random_params(rng) for _ in range(n)]
    seeds = seeds_for(rng, n)
    # Each mask allows an id its row could draw (finite and not banned): a row with none raises.
    drawable = [
        [t for t in range(VOCAB) if np.isfinite(rows.logits[i, t]) and t not in rows.banned[i]]
        for i in range(n)
    ]
    masks = [random_mask(rng, VOCAB, int(rng.choice(d))) if rng.random() < 0.7 else None for d in drawable]
    as_bans = [
        sorted({*b, *(t for t in range(VOCAB) if not allows(m, t))}) if m is not None else b
        for b, m in zip(rows.banned, masks, strict=True)
    ]
    logits = torch.from_numpy(rows.logits).to(DEVICE)

    def batch(banned: list[list[int]], allowed: list[np.ndarray | None] | None) -> SamplingBatch:
        return SamplingBatch.build(
            params, seeds, rows.prompt, rows.output, banned, DEVICE, vocab_size=VOCAB, allowed=allowed
        )

    masked, banned = batch(rows.banned, masks), batch(as_bans, None)
    got, want = sample(logits, masked).to_host(masked), sample(logits, banned).to_host(banned)
    assert got == want
    for (token, _, _), mask in zip(got, masks, strict=True):
        assert token < 0 or mask is None or allows(mask, token)
    assert torch.equal(probabilities(logits, masked), probabilities(logits, banned))
    with pytest.raises(ValueError, match="token mask has shape"):
        batch(rows.banned, [np.zeros(3, dtype=np.int32)] * n)


def torch_llm(path: Path) -> ob.LLM:
    return ob.LLM(path, device="cpu", runner="torch", max_model_len=256, max_num_seqs=4, kv_cache_dtype="f32")


def generate(path: Path, prompts: list[str], params: list[ob.SamplingParams]) -> list[ob.CompletionOutput]:
    return [r.outputs[0] for r in torch_llm(path).generate(prompts, params)]


def test_torch_outputs_follow_the_grammar_with_device_sampling_on_and_off(tiny_model, rng, monkeypatch):
    kinds = [str(k) for k in rng.choice(sorted(SPECS), 5)]
    prompts = random_text_prompts(rng, len(kinds))
    greedy = [ob.SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=SPECS[k]) for k in kinds]
    sampled = [
        ob.SamplingParams(max_tokens=24, temperature=1.0, seed=int(s), structured_outputs=SPECS[k])
        for k, s in zip(kinds, rng.integers(0, 2**63, len(kinds)), strict=True)
    ]
    runs = {}
    for on in ("0", "1"):
        for name in ("OXIBONSAI_DEVICE_SAMPLING", "OXIBONSAI_ASYNC_OUTPUT", "OXIBONSAI_ASYNC_SCHEDULING"):
            monkeypatch.setenv(name, on)
        runs[on] = generate(tiny_model, prompts * 2, greedy + sampled)
    llm = torch_llm(tiny_model)
    stops = llm.tokenizer.stop_token_ids
    for outs in runs.values():
        for out, params, kind in zip(outs, greedy + sampled, kinds * 2, strict=True):
            assert params.structured_outputs is not None
            grammar = llm._engine._grammars.compile(params.structured_outputs)
            for token in out.token_ids:
                assert not grammar.done and allows(grammar.mask(), token)
                if token not in stops:
                    grammar.accept([token])
            if out.finish_reason == "stop":
                assert satisfies(kind, out.text), out.text
    greedy_tokens = {on: [o.token_ids for o in outs[: len(kinds)]] for on, outs in runs.items()}
    assert greedy_tokens["0"] == greedy_tokens["1"]

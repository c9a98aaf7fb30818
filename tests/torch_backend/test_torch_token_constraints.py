"""``allowed_token_ids`` and ``bad_words`` on the torch runner (CPU device), with device sampling,
async output and steps launched ahead on and off: no output spells a bad word or leaves the allowed
ids (a step is not launched ahead of a token that a bad word's ban depends on), and greedy tokens are
the same either way."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from test_token_constraints import contains, random_prompts, words_of
from test_torch_structured_output import torch_llm

import oxibonsai as ob
from oxibonsai.token_constraints import bad_word_sequences


def test_torch_outputs_keep_the_constraints_with_device_sampling_on_and_off(tiny_model, rng, monkeypatch):
    llm = torch_llm(tiny_model)
    vocab = llm._engine.vocab_size
    prompts = random_prompts(rng, 4)
    params = []
    for i, prompt in enumerate(prompts * 2):
        temperature = 0.0 if i < len(prompts) else 1.0
        seed = int(rng.integers(2**63))
        free = llm.generate([prompt], ob.SamplingParams(max_tokens=20, temperature=temperature, seed=seed))
        fields: dict = {"bad_words": words_of(llm, free[0].outputs[0].token_ids or [5], rng, 3)}
        if i % 2:
            fields["allowed_token_ids"] = [int(t) for t in rng.choice(vocab, 50, replace=False)]
        params.append(ob.SamplingParams(max_tokens=20, temperature=temperature, seed=seed, **fields))
    runs = {}
    for on in ("0", "1"):
        for name in ("OXIBONSAI_DEVICE_SAMPLING", "OXIBONSAI_ASYNC_OUTPUT", "OXIBONSAI_ASYNC_SCHEDULING"):
            monkeypatch.setenv(name, on)
        runs[on] = [r.outputs[0] for r in torch_llm(tiny_model).generate(prompts * 2, params)]
    for outs in runs.values():
        for out, p in zip(outs, params, strict=True):
            for seq in bad_word_sequences(p.bad_words or [], llm.tokenizer):
                assert not contains(out.token_ids, seq)
            if p.allowed_token_ids is not None:
                assert set(out.token_ids) <= set(p.allowed_token_ids)
    greedy = {on: [o.token_ids for o in outs[: len(prompts)]] for on, outs in runs.items()}
    assert greedy["0"] == greedy["1"]
    assert np.mean([len(o.token_ids) for o in runs["1"]]) > 1

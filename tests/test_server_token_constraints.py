"""vLLM's ``allowed_token_ids`` and ``bad_words`` through the OpenAI-compatible routes (in process, the
embedded default model): the same tokens as the engine with the same ``SamplingParams``, on both
endpoints; malformed lists and ids outside the vocabulary are 400s naming the field."""

from __future__ import annotations

import random

import pytest
from test_server_structured_output import post, prompt_words

import oxibonsai as ob

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def reference() -> ob.LLM:
    return ob.LLM(None)


def test_both_endpoints_give_the_engines_constrained_tokens(default_app, default_engine, reference):
    rng = random.Random()
    prompt = prompt_words(rng)
    free = reference.generate([prompt], ob.SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    words = [w for w in free.text.split() if w.strip()][:3] or ["the"]
    allowed = sorted(rng.sample(range(reference._engine.vocab_size), 200))
    fields = {"max_tokens": 24, "temperature": 0, "bad_words": words, "allowed_token_ids": allowed}
    want = reference.generate([prompt], ob.SamplingParams(**fields))[0].outputs[0]
    assert set(want.token_ids) <= set(allowed)
    r = post(default_app, "/v1/completions", {"prompt": prompt, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.text
    messages = [{"role": "user", "content": prompt}]
    chat_want = reference.generate([default_engine.chat_prompt(messages)], ob.SamplingParams(**fields))
    r = post(default_app, "/v1/chat/completions", {"messages": messages, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == chat_want[0].outputs[0].text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**8]}, "allowed_token_ids id 100000000 is out of range"),
        ({"allowed_token_ids": ["1"]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": "no"}, "bad_words"),
    ],
)
def test_malformed_constraints_are_400s(default_app, fields, message):
    r = post(default_app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert message in r.text

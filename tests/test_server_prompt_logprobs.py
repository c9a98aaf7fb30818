"""vLLM's ``prompt_logprobs`` request field on both endpoints (in process, the embedded default model):
per prompt token null (the first) or ``{id: {logprob, rank, decoded_token}}`` with the top ``k`` ids and
the prompt's own token, equal to the engine's ``RequestOutput.prompt_logprobs`` for the same prompt;
per choice on completions, at the top level on chat; a 400 with ``stream`` or out of range."""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_server_structured_output import post, prompt_words

import oxibonsai as ob

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def reference() -> ob.LLM:
    return ob.LLM(None)


def want_json(llm: ob.LLM, prompt: str | list[int], k: int) -> list[Any]:
    out = llm.generate([prompt], ob.SamplingParams(max_tokens=1, prompt_logprobs=k))[0]
    assert out.prompt_logprobs is not None
    rows: list[Any] = [None]
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert entry is not None
        rows.append(
            {
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in entry.items()
                if t == token or (lp.rank is not None and lp.rank <= k)
            }
        )
    return rows


def check_shape(rows: list[Any], prompt_ids: list[int], k: int) -> None:
    assert len(rows) == len(prompt_ids) and rows[0] is None
    for token, row in zip(prompt_ids[1:], rows[1:], strict=True):
        assert str(token) in row
        ranks = sorted(v["rank"] for t, v in row.items() if t != str(token) or v["rank"] <= k)
        assert ranks == list(range(1, k + 1))


def test_completions_give_each_choice_the_engines_prompt_logprobs(default_app, reference):
    rng = random.Random()
    prompt = prompt_words(rng)
    k = rng.randint(0, 5)
    body = {"prompt": prompt, "max_tokens": 3, "prompt_logprobs": k, "n": 2, "temperature": 1.0}
    r = post(default_app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    want = want_json(reference, prompt, k)
    check_shape(want, reference.tokenizer.encode(prompt), k)
    for choice in r.json()["choices"]:
        assert choice["prompt_logprobs"] == want
    # echo scores the prompt for its own logprobs; prompt_logprobs still shows k of them
    echoed = post(default_app, "/v1/completions", {**body, "echo": True, "logprobs": 5, "n": 1}).json()
    assert echoed["choices"][0]["prompt_logprobs"] == want
    assert (
        "prompt_logprobs" not in post(default_app, "/v1/completions", {"prompt": prompt}).json()["choices"][0]
    )


def test_chat_gives_the_prompt_logprobs_at_the_top_level(default_app, default_engine, reference):
    messages = [{"role": "user", "content": prompt_words(random.Random())}]
    r = post(
        default_app, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 2}
    )
    assert r.status_code == 200, r.text
    assert r.json()["prompt_logprobs"] == want_json(reference, default_engine.chat_prompt(messages), 2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_prompt_logprobs_errors_are_400s(default_app, fields, message):
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = post(default_app, path, {**body, "max_tokens": 2, **fields})
        assert r.status_code == 400, r.text
        assert message in r.text

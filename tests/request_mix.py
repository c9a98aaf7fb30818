"""A mix of requests of every kind the engine serves, and a summary of a request's output to compare
runs by: for the tests that check an engine variant changes no output."""

from __future__ import annotations

from typing import Any

import numpy as np

import oxibonsai as ob


def summary(out: ob.RequestOutput) -> tuple[Any, ...]:
    c = out.outputs[0]
    logprobs = (
        None if c.logprobs is None else [sorted((t, lp.logprob) for t, lp in e.items()) for e in c.logprobs]
    )
    return (out.finished, c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason, logprobs,
            c.cumulative_logprob)  # fmt: skip


def mixed_requests(llm: ob.LLM, rng: np.random.Generator) -> list[tuple[list[int], ob.SamplingParams]]:
    """Ten requests of every kind; stop strings and stop ids taken from a greedy run, so they fire."""
    prompts = [[int(t) for t in rng.integers(0, 300, int(rng.integers(2, 40)))] for _ in range(10)]
    greedy = ob.SamplingParams(max_tokens=int(rng.integers(6, 20)), temperature=0.0, ignore_eos=True)
    probe = [o.outputs[0] for o in llm.generate(prompts, greedy)]
    text = probe[2].text
    stop = text[len(text) // 3 : len(text) // 3 + 3] or text
    seed = int(rng.integers(0, 2**63))
    kinds = [
        greedy,
        ob.SamplingParams(max_tokens=15, temperature=0.9, top_p=0.9, seed=seed, logprobs=3, ignore_eos=True),
        ob.SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], ignore_eos=True),
        ob.SamplingParams(
            max_tokens=20, temperature=0.0, stop_token_ids=[probe[3].token_ids[3]], ignore_eos=True
        ),
        ob.SamplingParams(
            max_tokens=12, temperature=0.0, min_tokens=5, stop_token_ids=[probe[4].token_ids[1]]
        ),
        ob.SamplingParams(max_tokens=1, temperature=0.0),
        ob.SamplingParams(max_tokens=18, temperature=1.2, top_k=20, seed=seed + 1, presence_penalty=0.5),
        ob.SamplingParams(max_tokens=9, temperature=0.0, logprobs=2, ignore_eos=True),
        ob.SamplingParams(max_tokens=25, temperature=0.7, min_p=0.05, seed=seed + 2),
        ob.SamplingParams(max_tokens=14, temperature=0.0, stop=[stop, "zz"], include_stop_str_in_output=True),
    ]
    return list(zip(prompts, kinds, strict=True))

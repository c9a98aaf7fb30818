"""``allowed_token_ids`` and ``bad_words`` (``token_constraints``), from their masks and bans to the
engine's tokens.

The pieces are checked against brute force (a set of ids for the mask, "does the output plus this id
end with a bad sequence" for the bans). End to end, the reference is the structured-output one: the
generated tokens recomputed in one forward pass (``LLM.logits``, bit-identical to the steps) and the
request's own seeded Rust sampler replayed over those rows with the brute-force mask and bans; the
engine must give exactly those tokens, alone or batched, chunked and preempted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai.token_constraints import BadWords, allowed_mask, bad_word_sequences, both, leaves_a_token


def mask_ids(mask: np.ndarray, vocab: int) -> set[int]:
    return {t for t in range(vocab) if int(mask[t // 32]) >> (t % 32) & 1}


def brute_banned(sequences: list[list[int]], output: list[int], vocab: int) -> list[int]:
    """Every id that would make the output end with one of ``sequences``."""
    return [t for t in range(vocab) if any([*output, t][-len(s) :] == s for s in sequences)]


def contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def test_allowed_mask_sets_exactly_the_ids(rng):
    for _ in range(20):
        vocab = int(rng.integers(1, 300))
        ids = sorted({int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 40)))})
        mask = allowed_mask(ids, vocab)
        assert mask.dtype == np.int32 and len(mask) == (vocab + 31) // 32
        assert mask_ids(mask, vocab) == set(ids)
        other = allowed_mask(sorted({int(t) for t in rng.integers(0, vocab, 5)}), vocab)
        common = both(mask, other)
        assert common is not None
        want = mask_ids(mask, vocab) & mask_ids(other, vocab) or mask_ids(other, vocab)
        assert mask_ids(common, vocab) == want, "no id in common keeps the grammar's mask"
        banned = [int(t) for t in rng.choice(ids, int(rng.integers(0, len(ids) + 1)), replace=False)]
        assert leaves_a_token(mask, banned) == (len(banned) < len(ids))
    assert both(None, mask) is mask and both(mask, None) is mask and both(None, None) is None


def test_bad_word_bans_equal_brute_force(rng):
    vocab = 12
    for _ in range(200):
        sequences = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 4)))] for _ in range(3)]
        bad = BadWords(sequences)
        output = [int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 6)))]
        assert bad.banned_after(output) == brute_banned(sequences, output, vocab)
        assert bad.depends_on_output == any(len(s) > 1 for s in sequences)
        assert bad.token_ids() == {t for s in sequences for t in s}


def test_bad_word_sequences_spell_the_word_bare_and_after_a_space(llm):
    tok = llm.tokenizer
    for word in ("world", " the user", "Hello"):
        sequences = bad_word_sequences([word], tok)
        bare = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        assert sequences[0] == bare
        assert (spaced in sequences) == (spaced[0] != bare[0] and len(spaced) == len(bare))
        for seq in sequences:
            assert tok.decode(seq).strip() == word.strip()


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> ob.LLM:
    return ob.LLM(tiny_model, max_model_len=256, max_num_seqs=4)


def replay(llm: ob.LLM, prompt: list[int], out: ob.CompletionOutput, params: ob.SamplingParams) -> None:
    """Checks ``out`` token by token against the reference of the module doc."""
    assert params.seed is not None
    vocab = llm._engine.vocab_size
    rows = llm.logits(prompt + out.token_ids)[len(prompt) - 1 :]
    sampler = params.sampler(0)
    allowed = None if params.allowed_token_ids is None else allowed_mask(params.allowed_token_ids, vocab)
    sequences = bad_word_sequences(params.bad_words or [], llm.tokenizer)
    for i, token in enumerate(out.token_ids):
        banned = brute_banned(sequences, out.token_ids[:i], vocab)
        want = sampler.sample(rows[i], prompt, out.token_ids[:i], banned, None, allowed)[0]
        assert token == want, f"token {i}: {token}, the reference samples {want}"
    for seq in sequences:
        assert not contains(out.token_ids, seq), f"the output spells bad sequence {seq}"
    if params.allowed_token_ids is not None:
        assert set(out.token_ids) <= set(params.allowed_token_ids)


def random_prompts(rng: np.random.Generator, n: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(3, 300, int(k))] for k in rng.integers(4, 40, n)]


def words_of(llm: ob.LLM, tokens: list[int], rng: np.random.Generator, n: int) -> list[str]:
    """``n`` texts of one to three consecutive tokens of ``tokens`` that are not only whitespace (a
    fixed word where the tokens decode to none, e.g. only special or space tokens)."""
    words: list[str] = []
    for _ in range(50 * n):
        start = int(rng.integers(0, len(tokens)))
        text = llm.tokenizer.decode(tokens[start : start + int(rng.integers(1, 4))])
        if text.strip():
            words.append(text)
        if len(words) == n:
            return words
    return words + ["the"] * (n - len(words))


def test_allowed_token_ids_are_the_only_draws_and_equal_the_reference(llm, rng):
    vocab = llm._engine.vocab_size
    for prompt in random_prompts(rng, 3):
        for temperature in (0.0, float(rng.uniform(0.5, 1.5))):
            ids = [int(t) for t in rng.choice(vocab, int(rng.integers(1, 30)), replace=False)]
            params = ob.SamplingParams(
                max_tokens=24, temperature=temperature, allowed_token_ids=ids, seed=int(rng.integers(2**63))
            )
            out = llm.generate([prompt], params)[0].outputs[0]
            replay(llm, prompt, out, params)


def test_bad_words_are_never_generated_and_equal_the_reference(llm, rng):
    changed = longer = 0
    for prompt in random_prompts(rng, 4):
        for temperature in (0.0, float(rng.uniform(0.5, 1.2))):
            seed = int(rng.integers(2**63))
            free = llm.generate(
                [prompt], ob.SamplingParams(max_tokens=32, temperature=temperature, seed=seed)
            )
            tokens = free[0].outputs[0].token_ids
            if not tokens:
                continue
            params = ob.SamplingParams(
                max_tokens=32, temperature=temperature, seed=seed, bad_words=words_of(llm, tokens, rng, 3)
            )
            out = llm.generate([prompt], params)[0].outputs[0]
            replay(llm, prompt, out, params)
            sequences = bad_word_sequences(params.bad_words or [], llm.tokenizer)
            changed += any(contains(tokens, s) for s in sequences)
            longer += any(len(s) > 1 for s in sequences)
    assert changed > 0, "no bad word appeared in an unconstrained output: nothing was tested"
    assert longer > 0, "no bad word of two or more tokens: the bans that follow the output went untested"


def test_batched_chunked_and_preempted_runs_equal_lone_runs(tiny_model, rng):
    prompts = random_prompts(rng, 6)
    lone = ob.LLM(tiny_model, max_model_len=256, max_num_seqs=1, enable_prefix_caching=False)
    vocab = lone._engine.vocab_size
    params = []
    for i, prompt in enumerate(prompts):
        seed = int(rng.integers(2**63))
        free = lone.generate([prompt], ob.SamplingParams(max_tokens=24, temperature=0.8, seed=seed))
        fields: dict = {"bad_words": words_of(lone, free[0].outputs[0].token_ids or [5], rng, 2)}
        if i % 2:
            fields["allowed_token_ids"] = [int(t) for t in rng.choice(vocab, 40, replace=False)]
        params.append(ob.SamplingParams(max_tokens=24, temperature=0.8, seed=seed, **fields))
    want = [lone.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    blocks = max(-(-(len(p) + 24) // 16) for p in prompts) + 2
    tight = ob.LLM(
        tiny_model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_blocks=blocks
    )
    plain = ob.SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    mixed = [x for pair in zip(prompts, prompts, strict=True) for x in pair]
    mixed_params = [x for pair in zip(params, [plain] * len(params), strict=True) for x in pair]
    assert [g.outputs[0].token_ids for g in tight.generate(mixed, mixed_params)[::2]] == want
    assert tight._engine.scheduler_stats()["preemptions"] > 0
    stats = tight.cache_stats()
    assert stats["free_blocks"] + stats["idle_blocks"] == stats["capacity_blocks"], "no block leaks"


def test_allowed_ids_meet_a_grammar_and_min_tokens(llm):
    tok = llm.tokenizer
    a, b = (tok.encode(c, add_special_tokens=False) for c in ("a", "b"))
    assert len(a) == len(b) == 1
    # The grammar allows a or b at every step; the list only b (and the stop ids, to end).
    stops = sorted(tok.stop_token_ids)
    params = ob.SamplingParams(
        max_tokens=6, allowed_token_ids=b + stops, structured_outputs={"regex": "[ab]{1,4}"}, seed=1
    )
    out = llm.generate(["Hello"], params)[0].outputs[0]
    assert out.text and set(out.text) == {"b"}
    # Only stop ids allowed: min_tokens yields rather than leaving nothing to sample.
    out = llm.generate(["Hello"], ob.SamplingParams(max_tokens=4, min_tokens=3, allowed_token_ids=stops))
    assert out[0].outputs[0].finish_reason == "stop" and len(out[0].outputs[0].token_ids) == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids id 1000000 is out of range"),
        ({"allowed_token_ids": [], "bad_words": ["x"]}, "allowed_token_ids must name at least one"),
    ],
)
def test_bad_constraints_fail_before_anything_runs(llm, fields, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["a", "b"], [ob.SamplingParams(max_tokens=2), ob.SamplingParams(**fields)])
    assert not llm._engine.has_unfinished()


def test_bad_words_that_ban_every_allowed_id_are_refused(llm):
    ids = llm.tokenizer.encode("x", add_special_tokens=False)
    with pytest.raises(ValueError, match="bad_words ban every id of allowed_token_ids"):
        llm.generate(["a"], ob.SamplingParams(allowed_token_ids=ids, bad_words=["x"]))
    assert not llm._engine.has_unfinished()

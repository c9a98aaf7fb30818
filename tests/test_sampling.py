"""The native sampler against an independent numpy model of the whole pipeline, its draws, seeding,
penalties, bans and logprobs; and ``SamplingParams`` validation."""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from oxibonsai import SamplingParams
from oxibonsai._core import Sampler

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]


def _gap(values: F64, boundary: float) -> float:
    """The relative distance from a boundary value to the nearest *other* value: exact ties are decided
    the same way (by id) on both sides, but nearly equal values may swap under float32 rounding."""
    finite = values[np.isfinite(values) & (values != boundary)]
    return float(np.min(np.abs(finite - boundary), initial=math.inf)) / (1.0 + abs(boundary))


def reference(
    logits: F32, prompt: list[int], output: list[int], banned: list[int], p: SamplingParams
) -> tuple[F64, float]:
    """The final distribution (float64, full sorts) and how close the inputs are to a filter boundary.

    Penalties -> ban -> (greedy) -> temperature -> top-k -> top-p -> min-p -> normalize; ties in value
    go to the lower id. Raises ValueError when no token is left.
    """
    # The sampler's parameters and penalty arithmetic are float32; the rest is float64 here.
    f32 = np.float32
    x = logits.copy()
    seen = np.unique(np.array(prompt + output, dtype=np.int64))
    rep = f32(p.repetition_penalty)
    x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
    ids, counts = np.unique(np.array(output, dtype=np.int64), return_counts=True)
    x[ids] -= f32(p.frequency_penalty) * counts.astype(f32) + f32(p.presence_penalty)
    x = x.astype(np.float64)
    x[np.array(banned, dtype=np.int64)] = -np.inf
    order = np.lexsort((np.arange(x.size), -x))
    order = order[np.isfinite(x[order])]
    if order.size == 0:
        raise ValueError("no token can be sampled")
    probs = np.zeros(x.size)
    if f32(p.temperature) == 0 or p.top_k == 1:
        probs[order[0]] = 1.0
        return probs, _gap(x, x[order[0]])
    margin = math.inf
    y = (x - x[order[0]]) / float(f32(p.temperature))
    # Values that differ only below the shift's resolution are ties from here on (as in the sampler,
    # which works on shifted values): re-sort by the shifted value, ties by id.
    order = order[np.lexsort((order, -y[order]))]
    if 0 < p.top_k < order.size:
        margin = min(margin, _gap(y, y[order[p.top_k - 1]]), _gap(y, y[order[p.top_k]]))
        order = order[: p.top_k]
    w = np.exp(y[order])
    top_p, min_p = float(f32(p.top_p)), float(f32(p.min_p))
    if top_p < 1:
        before = np.concatenate([[0.0], np.cumsum(w)[:-1]]) / w.sum()
        margin = min(margin, float(np.min(np.abs(before - top_p))))
        keep = before < top_p
        keep[0] = True
        if not keep.all():  # near-equal tokens on both sides of the cut may swap under rounding
            cut = int(np.argmin(keep))
            margin = min(margin, _gap(y, y[order[cut - 1]]), _gap(y, y[order[cut]]))
        order, w = order[keep], w[keep]
    if min_p > 0:
        off = w != min_p  # the best token (weight 1) with min_p == 1 is an exact, not a near, tie
        margin = min(margin, float(np.min(np.abs(w[off] - min_p), initial=math.inf)))
        order, w = order[w >= min_p], w[w >= min_p]
    probs[order] = w / w.sum()
    return probs, margin


def log_softmax(logits: F32) -> F64:
    x = logits.astype(np.float64)
    m = x[np.isfinite(x)].max()
    return x - (m + np.log(np.sum(np.exp(x - m))))


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.05, 0.5, 1.0, 2.5]) | st.floats(0.05, 3.0),
    top_k=st.sampled_from([0, -1, 1, 2, 5, 50, 1000]),
    top_p=st.just(1.0) | st.floats(0.01, 1.0),
    min_p=st.just(0.0) | st.sampled_from([0.01, 0.3, 1.0]) | st.floats(0.0, 1.0),
    repetition_penalty=st.just(1.0) | st.floats(0.3, 3.0),
    presence_penalty=st.just(0.0) | st.floats(-2.0, 2.0),
    frequency_penalty=st.just(0.0) | st.floats(-2.0, 2.0),
)


@settings(max_examples=400, deadline=None)
@given(
    params=params_strategy,
    seed=st.integers(0, 2**63),
    vocab=st.integers(2, 300),
    scale=st.floats(0.1, 10.0),
    ties=st.booleans(),
)
def test_probabilities_match_the_numpy_reference(
    params: SamplingParams, seed: int, vocab: int, scale: float, ties: bool
) -> None:
    gen = np.random.default_rng(seed)
    logits = (gen.standard_normal(vocab) * scale).astype(np.float32)
    if ties:
        logits = np.round(logits)
    logits[gen.integers(0, vocab, size=gen.integers(0, 3))] = -np.inf
    prompt = gen.integers(0, vocab, size=gen.integers(0, 30)).tolist()
    output = gen.integers(0, vocab, size=gen.integers(0, 30)).tolist()
    banned = gen.choice(vocab, size=min(vocab - 1, int(gen.integers(0, 3))), replace=False).tolist()
    sampler = params.sampler(default_seed=0)
    try:
        want, margin = reference(logits, prompt, output, banned, params)
    except ValueError:
        with pytest.raises(ValueError, match="no token can be sampled"):
            sampler.probabilities(logits, prompt, output, banned)
        return
    assume(margin > 1e-4)  # closer than that, float32 vs float64 rounding may decide either way
    got = sampler.probabilities(logits, prompt, output, banned)
    assert got.dtype == np.float32 and got.shape == (vocab,)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert math.isclose(float(got.sum(dtype=np.float64)), 1.0, abs_tol=1e-5)


def test_temperature_zero_and_top_k_one_are_greedy(rng: np.random.Generator) -> None:
    logits = rng.standard_normal(500).astype(np.float32)
    best = int(np.argmax(logits))
    logits[best + 1 :][:3] = logits[best]  # later ties lose to the lowest id
    for sampler in (Sampler(temperature=0.0, seed=1), Sampler(temperature=3.0, top_k=1, seed=2)):
        tokens = {sampler.sample(logits, [], [])[0] for _ in range(20)}
        assert tokens == {best}
        probs = sampler.probabilities(logits, [], [])
        assert probs[best] == 1.0 and probs.sum() == 1.0


def test_empirical_distribution_matches_probabilities(rng: np.random.Generator) -> None:
    logits = rng.standard_normal(8).astype(np.float32)
    sampler = Sampler(temperature=0.8, top_k=6, min_p=0.02, seed=int(rng.integers(2**63)))
    banned = [int(np.argmax(logits))]
    probs = sampler.probabilities(logits, [1], [2], banned).astype(np.float64)
    n = 20_000
    counts = np.bincount([sampler.sample(logits, [1], [2], banned)[0] for _ in range(n)], minlength=8)
    assert counts[probs == 0].sum() == 0
    # Six standard deviations per token: a false alarm is far rarer than one in a billion runs.
    bound = 6 * np.sqrt(n * probs * (1 - probs)) + 1
    assert np.all(np.abs(counts - n * probs) <= bound), (counts, n * probs)


def test_a_seed_gives_a_fixed_sequence(rng: np.random.Generator) -> None:
    logits = (0.2 * rng.standard_normal(1000)).astype(np.float32)
    seed = int(rng.integers(2**63))

    def run(seed: int) -> list[int]:
        sampler = SamplingParams(temperature=1.0, top_p=0.95, seed=seed).sampler(default_seed=7)
        out: list[int] = []
        for _ in range(50):
            out.append(sampler.sample(logits, [1, 2, 3], out)[0])
        return out

    assert run(seed) == run(seed)
    assert run(seed) != run(seed + 1)
    # Without a request seed the engine's default seed is used.
    a = SamplingParams().sampler(default_seed=seed)
    b = Sampler(seed=seed)
    assert [a.sample(logits, [], [])[0] for _ in range(20)] == [
        b.sample(logits, [], [])[0] for _ in range(20)
    ]


def test_repetition_penalty_lowers_repeated_tokens(rng: np.random.Generator) -> None:
    logits = rng.standard_normal(50).astype(np.float32)
    pos, neg = int(np.argmax(logits)), int(np.argmin(logits))
    plain = Sampler(repetition_penalty=1.0).probabilities(logits, [], [])
    for history in (([pos, neg], []), ([], [pos, neg])):
        penalized = Sampler(repetition_penalty=1.5).probabilities(logits, *history)
        for token in (pos, neg):
            assert penalized[token] < plain[token]


def test_presence_and_frequency_penalize_output_tokens_only(rng: np.random.Generator) -> None:
    logits = rng.standard_normal(20).astype(np.float32)
    sampler = Sampler(presence_penalty=0.5, frequency_penalty=0.25)
    plain = Sampler().probabilities(logits, [], [])
    got = sampler.probabilities(logits, [3, 4], [5, 5, 6])
    # Ratios to an untouched token show each token's logit shift.
    shift = np.log(got / got[0]) - np.log(plain / plain[0])
    np.testing.assert_allclose(shift[[3, 4, 7]], 0.0, atol=1e-5)
    np.testing.assert_allclose(shift[5], -(0.5 + 2 * 0.25), atol=1e-5)
    np.testing.assert_allclose(shift[6], -(0.5 + 0.25), atol=1e-5)


def test_banned_tokens_are_never_drawn(rng: np.random.Generator) -> None:
    logits = rng.standard_normal(10).astype(np.float32)
    banned = np.argsort(logits)[-3:].tolist()  # the three most likely
    sampler = Sampler(temperature=2.0, seed=int(rng.integers(2**63)))
    drawn = {sampler.sample(logits, [], [], banned)[0] for _ in range(2000)}
    assert drawn.isdisjoint(banned)
    assert len(drawn) == 7
    with pytest.raises(ValueError, match="no token can be sampled"):
        sampler.sample(logits, [], [], list(range(10)))


def test_logprobs_are_the_raw_log_softmax_sorted(rng: np.random.Generator) -> None:
    logits = (3 * rng.standard_normal(300)).astype(np.float32)
    logits[5] = -np.inf
    want = log_softmax(logits)
    sampler = Sampler(temperature=0.5, top_k=10, repetition_penalty=2.0, seed=3)
    token, logprob, top = sampler.sample(logits, [0, 1, 2], [3], logprobs=20)
    assert math.isclose(logprob, want[token], abs_tol=1e-5)
    assert len(top) == 20
    order = np.lexsort((np.arange(300), -want))[:20]
    assert [i for i, _ in top] == order.tolist()
    np.testing.assert_allclose([lp for _, lp in top], want[order], atol=1e-5)
    assert sampler.sample(logits, [], [])[2] == []


@pytest.mark.parametrize(
    "config",
    [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}, {"repetition_penalty": 1.5}],
)
def test_no_logprobs_asked_for_gives_none_and_the_same_tokens(rng: np.random.Generator, config: dict) -> None:
    """`logprobs=None` skips the normalizer (the engine passes it when a request wants no logprobs); the
    draws, and so the random stream, are those of `logprobs=0`."""
    logits = (2 * rng.standard_normal((30, 500))).astype(np.float32)
    logits[:, 7] = -np.inf
    with_lp, without = Sampler(**config), Sampler(**config)
    for row in logits:
        token, logprob, top = without.sample(row, [1, 2], [3], logprobs=None)
        assert (logprob, top) == (None, [])
        assert token == with_lp.sample(row, [1, 2], [3], logprobs=0)[0]


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_are_value_errors(bad: float) -> None:
    logits = np.zeros(10, np.float32)
    logits[4] = bad
    with pytest.raises(ValueError, match=r"logits\[4\] is .*finite or -inf"):
        Sampler().sample(logits, [], [])
    with pytest.raises(ValueError, match=r"logits\[4\]"):
        Sampler().probabilities(logits, [], [])


def test_bad_sampler_arguments() -> None:
    logits = np.zeros(10, np.float32)
    with pytest.raises(TypeError, match="float32, got float64"):
        Sampler().sample(np.zeros(10), [], [])
    with pytest.raises(ValueError, match="must be 1-D"):
        Sampler().sample(np.zeros((2, 5), np.float32), [], [])
    with pytest.raises(ValueError, match="must not be empty"):
        Sampler().sample(np.zeros(0, np.float32), [], [])
    with pytest.raises(TypeError, match="prompt_ids must be a sequence of int token ids, got str"):
        Sampler().sample(logits, "abc", [])
    with pytest.raises(ValueError, match=r"output_ids\[1\] = -1 is not a valid token id"):
        Sampler().sample(logits, [], [0, -1])
    with pytest.raises(ValueError, match=r"banned\[0\] = 10 is not a token id of a vocabulary of 10"):
        Sampler().sample(logits, [], [], [10])
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\], got 0"):
        Sampler(top_p=0.0)


INVALID: list[tuple[str, object, type[Exception], str]] = [
    ("n", 0, ValueError, "n must be >= 1, got 0"),
    ("n", 1.0, TypeError, "n must be an int, got float"),
    ("max_tokens", 0, ValueError, "max_tokens must be >= 1 or None, got 0"),
    ("max_tokens", True, TypeError, "max_tokens must be an int, got bool"),
    ("min_tokens", -1, ValueError, "min_tokens must be >= 0, got -1"),
    ("min_tokens", 17, ValueError, r"min_tokens must be <= max_tokens \(16\), got 17"),
    ("temperature", -0.1, ValueError, "temperature must be a finite number >= 0, got -0.1"),
    ("temperature", math.nan, ValueError, "temperature must be a finite number >= 0, got nan"),
    ("temperature", "hot", TypeError, "temperature must be a number, got str 'hot'"),
    ("top_k", -2, ValueError, r"top_k must be -1 or 0 \(off\) or >= 1, got -2"),
    ("top_k", 2.5, TypeError, "top_k must be an int, got float"),
    ("top_p", 0.0, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_p", 1.5, ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    ("min_p", -0.1, ValueError, r"min_p must be in \[0, 1\], got -0.1"),
    ("min_p", math.inf, ValueError, r"min_p must be in \[0, 1\], got inf"),
    ("repetition_penalty", 0.0, ValueError, "repetition_penalty must be a finite number > 0, got 0.0"),
    ("presence_penalty", 2.5, ValueError, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ("frequency_penalty", -3, ValueError, r"frequency_penalty must be in \[-2, 2\], got -3.0"),
    ("frequency_penalty", None, TypeError, "frequency_penalty must be a number, got NoneType"),
    ("seed", -1, ValueError, r"seed must be in \[0, 2\*\*64\) or None, got -1"),
    ("seed", 2**64, ValueError, r"seed must be in \[0, 2\*\*64\) or None"),
    ("seed", "42", TypeError, "seed must be an int, got str"),
    ("stop", 5, TypeError, "stop must be a str, a list of str or None, got int"),
    ("stop", ["a", ""], ValueError, r"stop\[1\] must be a non-empty string"),
    ("stop", "", ValueError, r"stop\[0\] must be a non-empty string"),
    ("stop", ["a", 1], TypeError, r"stop\[1\] must be a str, got int"),
    ("stop_token_ids", [1, -2], ValueError, r"stop_token_ids\[1\] must be a token id in \[0, 4294967296\)"),
    ("stop_token_ids", [True], TypeError, r"stop_token_ids\[0\] must be an int, got bool"),
    ("stop_token_ids", 3, TypeError, "stop_token_ids must be a list of int or None, got int"),
    ("ignore_eos", 1, TypeError, "ignore_eos must be a bool, got int"),
    ("include_stop_str_in_output", "yes", TypeError, "include_stop_str_in_output must be a bool"),
    ("skip_special_tokens", None, TypeError, "skip_special_tokens must be a bool"),
    ("logprobs", 21, ValueError, r"logprobs must be in \[0, 20\] or None, got 21"),
    ("logprobs", -1, ValueError, r"logprobs must be in \[0, 20\] or None, got -1"),
    ("prompt_logprobs", 21, ValueError, r"prompt_logprobs must be in \[0, 20\] or None, got 21"),
    ("prompt_logprobs", True, TypeError, r"prompt_logprobs must be an int, got bool True"),
    ("logit_bias", [(1, 2.0)], TypeError, "logit_bias must be a dict of token id to number or None"),
    ("logit_bias", {"7": 1.0}, TypeError, "logit_bias key '7' must be an int, got str"),
    ("logit_bias", {-1: 1.0}, ValueError, r"logit_bias key -1 must be a token id in \[0, 4294967296\)"),
    ("logit_bias", {3: 100.5}, ValueError, r"logit_bias\[3\] must be in \[-100, 100\], got 100.5"),
    ("logit_bias", {3: math.nan}, ValueError, r"logit_bias\[3\] must be in \[-100, 100\], got nan"),
    ("logit_bias", {3: "up"}, TypeError, r"logit_bias\[3\] must be a number, got str"),
    ("allowed_token_ids", [], ValueError, r"allowed_token_ids must name at least one token id"),
    (
        "allowed_token_ids",
        [3, -1],
        ValueError,
        r"allowed_token_ids\[1\] must be a token id in \[0, 4294967296\)",
    ),
    ("allowed_token_ids", 3, TypeError, "allowed_token_ids must be a list of int or None, got int"),
    ("allowed_token_ids", [1.0], TypeError, r"allowed_token_ids\[0\] must be an int, got float"),
    ("bad_words", "bad", TypeError, "bad_words must be a list of str or None, got str"),
    ("bad_words", ["ok", 3], TypeError, r"bad_words\[1\] must be a str, got int"),
    ("bad_words", [" \n"], ValueError, r"bad_words\[0\] must have a character other than whitespace"),
    ("structured_outputs", "a+", TypeError, "structured_outputs must be a StructuredOutputsParams"),
    ("structured_outputs", {"regex": "a", "json": {}}, ValueError, "exactly one of"),
    ("thinking_token_budget", -1, ValueError, "thinking_token_budget must be >= 0 or None, got -1"),
    ("thinking_token_budget", True, TypeError, "thinking_token_budget must be an int, got bool"),
    ("truncate_prompt_tokens", 0, ValueError, "truncate_prompt_tokens must be -1, >= 1 or None, got 0"),
    ("truncate_prompt_tokens", "8", TypeError, "truncate_prompt_tokens must be an int, got str"),
    ("logits_processors", [None], TypeError, r"logits_processors\[0\] must be callable, got NoneType"),
]


@pytest.mark.parametrize(
    ("field", "value", "error", "message"), INVALID, ids=[f"{c[0]}={c[1]!r}" for c in INVALID]
)
def test_invalid_sampling_params_name_the_field(
    field: str, value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(**{field: value})


def test_every_field_has_an_invalid_case() -> None:
    assert {f.name for f in fields(SamplingParams)} == {case[0] for case in INVALID}


def test_sampling_params_defaults_and_normalization() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_k, p.top_p) == (1, 16, 0, 1.0, 0, 1.0)
    assert (p.stop, p.stop_token_ids, p.seed, p.logprobs) == ([], [], None, None)
    p = SamplingParams(stop="###", stop_token_ids=(7, np.int64(8)), max_tokens=None, min_tokens=50, top_k=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [7, 8] and type(p.stop_token_ids[1]) is int
    assert p.max_tokens is None and p.min_tokens == 50
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(allowed_token_ids=(9, 2, np.int32(9))).allowed_token_ids == [2, 9]
    assert SamplingParams(bad_words=("a", " b")).bad_words == ["a", " b"]
    assert SamplingParams(bad_words=[]).bad_words is None
    assert SamplingParams(temperature=1, seed=np.uint64(5)).temperature == 1.0
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # keyword-only: a positional value is a mistake
    with pytest.raises(ValueError, match=r"default_seed must be in \[0, 2\*\*64\)"):
        SamplingParams().sampler(default_seed=-1)


def test_logit_bias_is_normalized_and_reaches_the_sampler(rng: np.random.Generator) -> None:
    p = SamplingParams(logit_bias={np.int64(4): 1, 9: -100.0})
    assert p.logit_bias == {4: 1.0, 9: -100.0} and all(type(k) is int for k in p.logit_bias)
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams(temperature=0.0, logit_bias={1: 0.5}).is_plain_greedy
    logits = rng.normal(size=64).astype(np.float32)
    best = int(np.argmax(logits))
    other = int(np.argmin(logits))
    greedy = SamplingParams(temperature=0.0, logit_bias={best: -100.0, other: 100.0}).sampler(0)
    token, logprob, top = greedy.sample(logits, [], [], None, 64)
    assert token == other
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert logprob == pytest.approx(raw[other], abs=1e-5), "logprobs are the raw ones"
    assert top[0][0] == best and len(top) == 64
    seeded = SamplingParams(seed=1, logit_bias={best: -100.0}).sampler(0)
    assert all(seeded.sample(logits, [], [], None, None)[0] != best for _ in range(2000))
    with pytest.raises(ValueError, match="logit_bias token 64 is not a token id of a vocabulary of 64"):
        SamplingParams(logit_bias={64: 1.0}).sampler(0).sample(logits, [], [])
    with pytest.raises(ValueError, match="logit_bias names token 3 twice"):
        Sampler(logit_bias=[(3, 1.0), (3, 2.0)])


def test_plain_greedy_is_greedy_without_penalties_or_logprobs() -> None:
    """What the device's greedy short path may draw; float32 decides as the samplers do."""
    plain = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-50),  # 0 in float32
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.0 + 1e-9),  # 1 in float32
    ]
    other = [
        SamplingParams(),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, presence_penalty=-0.5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]),
        SamplingParams(temperature=0.0, bad_words=["x"]),
    ]
    assert [p.is_plain_greedy for p in plain] == [True] * len(plain)
    assert [p.is_plain_greedy for p in other] == [False] * len(other)


def test_sample_rows_draws_each_row_as_its_sampler_alone(rng: np.random.Generator) -> None:
    """``_core.sample_rows`` (the engine's per-step draws, the rows in parallel) against each row's
    sampler called alone with the same arguments: the same tokens and logprobs, and the samplers'
    streams advanced alike (a second step agrees too)."""
    from oxibonsai import _core

    n, vocab = int(rng.integers(1, 9)), int(rng.integers(50, 3000))
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.3])), top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([0, 20])), repetition_penalty=float(rng.choice([1.0, 1.2])),
            seed=int(rng.integers(2**63)), logprobs=None if rng.random() < 0.5 else int(rng.integers(0, 4)),
        )
        for _ in range(n)
    ]  # fmt: skip
    prompts = [rng.integers(0, vocab, int(rng.integers(0, 20))).tolist() for _ in range(n)]
    outputs = [rng.integers(0, vocab, int(rng.integers(0, 5))).tolist() for _ in range(n)]
    banned = [None if rng.random() < 0.5 else [int(rng.integers(vocab))] for _ in range(n)]
    allowed = [None] * n
    allowed[0] = np.packbits(rng.random(vocab) < 0.5, bitorder="little").view(np.uint8)
    allowed[0] = np.pad(allowed[0], (0, (-len(allowed[0])) % 4)).view(np.int32)
    batched = [p.sampler(0) for p in params]
    alone = [p.sampler(0) for p in params]
    for _ in range(2):
        logits = rng.standard_normal((n, vocab)).astype(np.float32)
        got = _core.sample_rows(
            batched, logits, prompts, outputs, banned, [p.logprobs for p in params], allowed
        )
        want = [
            s.sample(logits[i], prompts[i], outputs[i], banned[i], params[i].logprobs, allowed[i])
            for i, s in enumerate(alone)
        ]
        assert got == want


def test_sample_rows_refuses_mismatched_rows_and_raises_a_rows_error() -> None:
    from oxibonsai import _core

    s = SamplingParams(temperature=1.0, seed=1).sampler(0)
    logits = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="one sampler, prompt_ids"):
        _core.sample_rows([s], logits, [[]], [[]], [None], [None], [None])
    logits[1, 3] = np.nan
    other = SamplingParams(temperature=1.0, seed=2).sampler(0)
    with pytest.raises(ValueError, match=r"logits\[3\] is NaN"):
        _core.sample_rows([s, other], logits, [[], []], [[], []], [None, None], [None, None], [None, None])
    with pytest.raises(RuntimeError, match="borrow"):  # one sampler for two rows
        _core.sample_rows(
            [s, s], np.zeros((2, 8), np.float32), [[], []], [[], []], [None] * 2, [None] * 2, [None] * 2
        )

"""Device sampling (``torch_backend.sampling``) against the Rust sampler it mirrors, ``_core.Sampler``
built by ``SamplingParams.sampler`` and called as the engine calls it.

Exact: greedy tokens (the penalized logits are the same float32 operations on both sides, ties go to the
lower id), top-k sets (ranked on those logits), top logprob ids and their order. Within 1e-5: the
filtered distribution (the exps differ: torch's vs the Rust polynomial, 3e-7 relative) and logprobs.
Rows whose top-p mass or min-p threshold lies within 1e-4 of deciding a token are redrawn, since there
rounding may decide either way. Draws: each token must be the inverse CDF, in ascending id, of the Rust
distribution at the row's uniform; the uniforms of fixed seeds are checked to be uniform (a
deterministic Kolmogorov-Smirnov bound, which then bounds every token's frequency, so nothing here can
flake). Seeded rows: the same token twice, alone and inside batches of other compositions."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace

import numpy as np
import pytest

from oxibonsai import SamplingParams

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from torch.overrides import TorchFunctionMode  # noqa: E402

from oxibonsai.torch_backend.sampling import (  # noqa: E402
    SamplingBatch,
    draw_uniform,
    probabilities,
    sample,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 300
MARGIN = 1e-4


@dataclass
class Rows:
    """Rows of logits with their histories and banned ids, and the batches built from them."""

    logits: np.ndarray  # float32 [n, vocab]
    prompt: list[list[int]]
    output: list[list[int]]
    banned: list[list[int]]

    @classmethod
    def random(cls, rng: np.random.Generator, n: int, vocab: int = VOCAB, *, ties: bool = True) -> Rows:
        """Logits (on even rows exact ties, tied maxima and signed zeros; some -inf), histories whose
        output ids repeat, and up to three banned ids per row."""
        x = rng.standard_normal((n, vocab)) * rng.uniform(0.5, 4.0, (n, 1))
        if ties:
            x[::2] = np.round(x[::2])
            x[::2, rng.integers(0, vocab, 3)] = x[::2].max(axis=1, keepdims=True)
        x[rng.random(x.shape) < 0.01] = -np.inf
        common = rng.integers(0, vocab, 12)
        return cls(
            x.astype(np.float32),
            [rng.integers(0, vocab, rng.integers(0, 30)).tolist() for _ in range(n)],
            [rng.choice(common, rng.integers(0, 25)).tolist() for _ in range(n)],
            [rng.choice(vocab, rng.integers(0, 4), replace=False).tolist() for _ in range(n)],
        )

    def __add__(self, other: Rows) -> Rows:
        logits = np.concatenate([self.logits, other.logits])
        return Rows(
            logits, self.prompt + other.prompt, self.output + other.output, self.banned + other.banned
        )

    def row(self, r: int) -> tuple[np.ndarray, list[int], list[int], list[int]]:
        return self.logits[r], self.prompt[r], self.output[r], self.banned[r]

    def batch(
        self,
        params: list[SamplingParams],
        seeds: list[int],
        rows: list[int] | None = None,
        steps: list[int] | None = None,
    ) -> tuple[torch.Tensor, SamplingBatch]:
        """The logits of ``rows`` (default all, in order) on the device and their batch."""
        rows = list(range(len(params))) if rows is None else rows
        batch = SamplingBatch.build(
            [params[r] for r in rows],
            [seeds[r] for r in rows],
            [self.prompt[r] for r in rows],
            [self.output[r] for r in rows],
            [self.banned[r] for r in rows],
            DEVICE,
            vocab_size=self.logits.shape[1],
            steps=steps,
        )
        return torch.from_numpy(self.logits[rows]).to(DEVICE), batch


def random_params(rng: np.random.Generator, **fixed: object) -> SamplingParams:
    def pick(*options: object) -> object:
        return options[int(rng.integers(len(options)))]

    kwargs = {
        "temperature": pick(0.0, 0.25, 0.7, 1.0, float(rng.uniform(0.1, 2.5))),
        "top_k": pick(0, -1, 1, 2, 20, VOCAB - 1, 5000),
        "top_p": pick(1.0, 1.0, float(rng.uniform(0.05, 1.0))),
        "min_p": pick(0.0, 0.0, 1.0, float(rng.uniform(0.0, 0.5))),
        "repetition_penalty": pick(1.0, float(rng.uniform(0.3, 3.0))),
        "presence_penalty": pick(0.0, float(rng.uniform(-2.0, 2.0))),
        "frequency_penalty": pick(0.0, float(rng.uniform(-2.0, 2.0))),
        "logprobs": pick(None, None, 0, 1, 5, 20),
        "logit_bias": pick(None, None, random_bias(rng)),
        **fixed,
    }
    return SamplingParams(**kwargs)


def random_bias(rng: np.random.Generator) -> dict[int, float]:
    """A few ids of the vocabulary with amounts in [-100, 100], the ends included."""
    ids = rng.choice(VOCAB, size=int(rng.integers(1, 8)), replace=False)
    amounts = [float(rng.choice([-100.0, 100.0, rng.uniform(-100, 100), rng.uniform(-3, 3)])) for _ in ids]
    return {int(t): a for t, a in zip(ids, amounts, strict=True)}


def seeds_for(rng: np.random.Generator, n: int) -> list[int]:
    return [int(s) for s in rng.integers(0, 2**64, n, dtype=np.uint64)]


def boundary_margin(p: SamplingParams, rows: Rows, r: int) -> float:
    """How far (relative) the row's top-p mass and min-p threshold are from deciding any token otherwise,
    from the Rust distribution without filters. Greedy rows and top-k compare equal float32 logits on
    both sides, so they need no margin."""
    if np.float32(p.temperature) == 0 or p.top_k == 1:
        return math.inf
    plain = SamplingParams(
        temperature=p.temperature,
        logit_bias=p.logit_bias,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    q = plain.sampler(0).probabilities(*rows.row(r)).astype(np.float64)
    order = np.lexsort((np.arange(q.size), -q))
    k = p.top_k if 0 < p.top_k < q.size else q.size
    w = q[order[:k]] / q.max()
    top_p, min_p = float(np.float32(p.top_p)), float(np.float32(p.min_p))
    margin = math.inf
    if top_p < 1:
        ahead = np.concatenate([[0.0], np.cumsum(w)[:-1]]) / w.sum()
        margin = float(np.min(np.abs(ahead - top_p)))
    if min_p > 0:
        off = w[w != min_p]  # the best token's weight is exactly 1 on both sides
        margin = min(margin, float(np.min(np.abs(off - min_p), initial=math.inf)) / min_p)
    return margin


def clear_params(rng: np.random.Generator, rows: Rows, r: int, **fixed: object) -> SamplingParams:
    """Random parameters for row r with no filter decision within MARGIN of rounding."""
    for _ in range(100):
        p = random_params(rng, **fixed)
        if boundary_margin(p, rows, r) > MARGIN:
            return p
    raise AssertionError("no parameters clear of the filter boundaries in 100 draws")


def rust_draw(p: SamplingParams, seed: int, rows: Rows, r: int):
    return p.sampler(seed).sample(*rows.row(r), p.logprobs)


def test_greedy_rows_equal_the_rust_sampler(rng: np.random.Generator) -> None:
    n = 24
    rows = Rows.random(rng, n)
    greedy = [{"temperature": 0.0}, {"top_k": 1, "temperature": 1.3}]
    params = [random_params(rng, **greedy[r % 2]) for r in range(n)]
    params[0] = SamplingParams(temperature=0.0)  # nothing changes the logits: Rust's plain argmax path
    rows.banned[0] = []
    seeds = seeds_for(rng, n)
    logits, batch = rows.batch(params, seeds)
    got = sample(logits, batch).to_host(batch)
    for r in range(n):
        assert got[r][0] == rust_draw(params[r], seeds[r], rows, r)[0], f"row {r}: {params[r]}"
    probs = probabilities(logits, batch).cpu().numpy()
    assert np.array_equal(probs, np.eye(VOCAB, dtype=np.float32)[[g[0] for g in got]])


def test_filtered_distribution_equals_the_rust_sampler(rng: np.random.Generator) -> None:
    n = 32
    rows = Rows.random(rng, n)
    params = [clear_params(rng, rows, r) for r in range(n)]
    logits, batch = rows.batch(params, seeds_for(rng, n))
    got = probabilities(logits, batch).cpu().numpy()
    for r in range(n):
        want = params[r].sampler(0).probabilities(*rows.row(r))
        assert np.array_equal(got[r] > 0, want > 0), f"row {r}: {params[r]}"
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-7, err_msg=f"row {r}: {params[r]}")


@pytest.mark.parametrize("mix", ["as drawn", "all ranked", "none ranked"])
def test_each_draw_is_the_inverse_cdf_of_the_rust_distribution(rng: np.random.Generator, mix: str) -> None:
    """The three ways of finding the candidates: mixed rows (weights over the vocabulary), top-k on
    every row (a window of the ranked ids), neither top-k nor top-p anywhere (no ranking)."""
    n = 32
    rows = Rows.random(rng, n)
    fixed = {"as drawn": {}, "all ranked": {"top_k": 40}, "none ranked": {"top_k": 0, "top_p": 1.0}}[mix]
    params = [clear_params(rng, rows, r, temperature=float(rng.uniform(0.2, 2.0)), **fixed) for r in range(n)]
    logits, batch = rows.batch(params, seeds_for(rng, n))
    tokens = sample(logits, batch).token_ids.cpu().numpy()
    uniforms = batch.uniforms.cpu().numpy()
    for r in range(n):
        want = params[r].sampler(0).probabilities(*rows.row(r)).astype(np.float64)
        t = int(tokens[r])
        cdf = np.cumsum(want) / want.sum()
        assert want[t] > 0
        assert cdf[t] - want[t] / want.sum() - 1e-6 <= uniforms[r] <= cdf[t] + 1e-6, f"row {r}: {params[r]}"


def test_exact_boundaries_decide_as_in_the_rust_sampler() -> None:
    """Cases where only the comparison itself decides (the Rust unit tests' cases): top-p keeps a token
    whose mass ahead is *below* the target, among tied tokens the lower ids; a weight under the Rust
    exp's floor (argument < -87) is zero; a tiny repetition penalty saturates at the float32 maximum
    instead of overflowing; the draw takes the first running sum *above* ``u * total``."""
    inf = -np.inf
    tied = np.full(10, inf, dtype=np.float32)
    tied[[5, 2, 9, 7]] = 0.0  # weights 1, 1, 1, 1: the mass ahead is exactly 0, 1, 2, 3
    floor = np.array([0.0, -86.0, -88.0, -100.0], dtype=np.float32)
    huge = np.array([1e10, 2e10, 3.0, inf], dtype=np.float32)
    cases = [
        (tied, [], SamplingParams(top_p=0.5), [2, 5]),
        (tied, [], SamplingParams(top_p=0.75), [2, 5, 7]),
        (tied, [], SamplingParams(top_p=0.2, top_k=3), [2]),
        (floor, [], SamplingParams(), [0, 1]),
        (huge, [0, 1, 3], SamplingParams(repetition_penalty=1e-30), [0, 1]),  # both become f32 max
    ]
    for logits, prompt, p, support in cases:
        rows = Rows(logits[None], [prompt], [[]], [[]])
        got = probabilities(*rows.batch([p], [0])).cpu().numpy()[0]
        want = p.sampler(0).probabilities(logits, prompt, [])
        assert np.flatnonzero(got).tolist() == np.flatnonzero(want).tolist() == support
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # Weights 0, 1, 0, 1: u = 0.5 puts the target exactly at the first running sum, which must exceed it.
    weights = np.tile(np.array([inf, 0.0, inf, 0.0], dtype=np.float32), (4, 1))
    logits, batch = Rows(weights, [[]] * 4, [[]] * 4, [[]] * 4).batch([SamplingParams()] * 4, [0] * 4)
    uniforms = torch.tensor([0.0, 0.4999, 0.5, 1 - 2**-53], dtype=torch.float64, device=DEVICE)
    assert sample(logits, replace(batch, uniforms=uniforms)).token_ids.tolist() == [1, 1, 3, 3]


def test_frequencies_over_fixed_seeds_match_the_rust_probabilities(rng: np.random.Generator) -> None:
    """4000 copies of one row with the fixed seeds 0..3999 (step 5): each token's frequency is the
    uniforms' mass on its CDF interval, so it is within twice their KS distance of the probability."""
    n, vocab = 4000, 8
    one = Rows.random(rng, 1, vocab, ties=False)
    rows = Rows(np.repeat(one.logits, n, axis=0), [[2, 7]] * n, [[1, 1, 2, 3, 4, 5]] * n, [[0]] * n)
    p = SamplingParams(temperature=0.8, top_k=6, repetition_penalty=1.3, frequency_penalty=0.4)
    logits, batch = rows.batch([p] * n, list(range(n)), steps=[5] * n)
    counts = np.bincount(sample(logits, batch).token_ids.cpu().numpy(), minlength=vocab)
    want = p.sampler(0).probabilities(*rows.row(0)).astype(np.float64)
    u = np.sort(batch.uniforms.cpu().numpy())
    ks = max(np.max(np.arange(1, n + 1) / n - u), np.max(u - np.arange(n) / n))
    assert ks < 1.36 / math.sqrt(n)  # the 5% critical value; deterministic for these seeds
    assert np.all(np.abs(counts / n - want) <= 2 * ks + 1e-6), (counts, n * want)


def test_uniforms_depend_on_seed_and_step_only() -> None:
    values = [draw_uniform(seed, step) for seed in (0, 1, 2**64 - 1) for step in range(50)]
    assert all(0.0 <= v < 1.0 for v in values) and len(set(values)) == len(values)
    assert draw_uniform(123, 7) == draw_uniform(123, 7)
    p = SamplingParams(temperature=1.0)
    batch = SamplingBatch.build([p, p], [9, 9], [[], []], [[1, 2], []], [[], []], DEVICE, vocab_size=4)
    assert batch.uniforms.tolist() == [draw_uniform(9, 2), draw_uniform(9, 0)]  # step = output length


def test_logprobs_and_top_equal_the_rust_sampler(rng: np.random.Generator) -> None:
    n = 16
    rows = Rows.random(rng, n)
    params = [random_params(rng, logprobs=[0, 1, 3, 20][r % 4]) for r in range(n)]
    params[-1] = random_params(rng, logprobs=None)
    seeds = seeds_for(rng, n)
    logits, batch = rows.batch(params, seeds)
    got = sample(logits, batch).to_host(batch)
    for r in range(n - 1):
        token, logprob, top = got[r]
        raw = dict(SamplingParams(temperature=0.0).sampler(0).sample(rows.logits[r], [], [], [], VOCAB)[2])
        want_token, _, want_top = rust_draw(params[r], seeds[r], rows, r)
        assert logprob is not None and abs(logprob - raw[token]) < 1e-5
        assert [i for i, _ in top] == [i for i, _ in want_top]  # ids and their ranks, ties by id
        np.testing.assert_allclose([v for _, v in top], [v for _, v in want_top], atol=1e-5)
        if np.float32(params[r].temperature) == 0 or params[r].top_k == 1:
            assert token == want_token
    assert got[-1][1:] == (None, [])


def test_more_logprobs_than_tokens_gives_the_whole_vocabulary(rng: np.random.Generator) -> None:
    rows = Rows.random(rng, 2, vocab=5)
    params = [SamplingParams(temperature=0.0, logprobs=20), SamplingParams(logprobs=2)]
    logits, batch = rows.batch(params, [1, 2])
    got = sample(logits, batch).to_host(batch)
    for r in range(2):
        want = rust_draw(params[r], 0, rows, r)[2]
        assert [i for i, _ in got[r][2]] == [i for i, _ in want] and len(want) == min(5, [20, 2][r])


def test_a_seeded_row_draws_the_same_token_in_any_batch(rng: np.random.Generator) -> None:
    n = 20
    rows = Rows.random(rng, n)
    params = [random_params(rng, temperature=float(rng.uniform(0.5, 2.0))) for r in range(n)]
    seeds = seeds_for(rng, n)
    tokens = sample(*rows.batch(params, seeds)).token_ids.tolist()
    assert sample(*rows.batch(params, seeds)).token_ids.tolist() == tokens
    order = rng.permutation(n).tolist()
    assert sample(*rows.batch(params, seeds, order)).token_ids.tolist() == [tokens[r] for r in order]
    for r in range(n):
        assert sample(*rows.batch(params, seeds, [r])).token_ids.tolist() == [tokens[r]]
    # Inside a larger batch whose other rows are greedy, unranked or ask for logprobs.
    mixed = rows + Rows.random(rng, 6)
    others = [SamplingParams(temperature=0.0), SamplingParams(min_p=0.1, logprobs=3)] * 3
    subset = rng.permutation(n + 6)[: n // 2 + 6].tolist()
    got = sample(*mixed.batch(params + others, seeds + seeds_for(rng, 6), subset)).token_ids.tolist()
    assert [t for t, r in zip(got, subset, strict=True) if r < n] == [tokens[r] for r in subset if r < n]


def test_a_mixed_batch_gives_each_row_what_it_gives_alone(rng: np.random.Generator) -> None:
    kinds = [
        {"temperature": 0.0},  # greedy
        {"temperature": 0.9, "top_k": 1, "logprobs": 2},  # greedy through top-k
        {"temperature": 1.1, "seed": int(rng.integers(2**63))},  # seeded, no ranking
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20},  # unseeded: the engine's seed
        {"temperature": 1.0, "min_p": 0.05, "logprobs": 5, "repetition_penalty": 1.2},
        {"temperature": 1.5, "top_k": 50, "frequency_penalty": 0.5, "logprobs": 0},
    ]
    n = 3 * len(kinds)
    rows = Rows.random(rng, n)
    params = [SamplingParams(**kinds[r % len(kinds)]) for r in range(n)]
    engine_seeds = seeds_for(rng, n)
    seeds = [p.seed if p.seed is not None else s for p, s in zip(params, engine_seeds, strict=True)]
    logits, batch = rows.batch(params, seeds)
    got = sample(logits, batch).to_host(batch)
    for r in range(n):
        alone = sample(*rows.batch(params, seeds, [r])).to_host(rows.batch(params, seeds, [r])[1])[0]
        assert got[r][0] == alone[0] and [i for i, _ in got[r][2]] == [i for i, _ in alone[2]]
        if alone[1] is not None:
            assert got[r][1] == pytest.approx(alone[1], abs=1e-6)
        want = params[r].sampler(seeds[r]).probabilities(*rows.row(r))
        assert want[got[r][0]] > 0, f"row {r} drew a token the Rust sampler never draws"
        if np.float32(params[r].temperature) == 0 or params[r].top_k == 1:
            assert got[r][0] == rust_draw(params[r], seeds[r], rows, r)[0]


class CountOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_the_number_of_ops_does_not_depend_on_the_number_of_rows(rng: np.random.Generator) -> None:
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.8, logprobs=3),
        SamplingParams(min_p=0.1),
    ]
    counts = []
    for n in (3, 30):
        rows = Rows.random(rng, n)
        rows.banned[0] = [0]  # the same features in both batches: some row bans a token
        logits, batch = rows.batch([kinds[r % 3] for r in range(n)], seeds_for(rng, n))
        with CountOps() as ops:
            sample(logits, batch)
        counts.append(ops.calls)
    assert counts[0] == counts[1]


def test_a_row_with_nothing_to_sample(rng: np.random.Generator) -> None:
    rows = Rows.random(rng, 3, vocab=6, ties=False)
    rows.logits[1, :3] = -np.inf
    rows.banned = [[], [3, 4, 5], [5]]
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=3), SamplingParams(top_p=0.5)]
    logits, batch = rows.batch(params, [0, 1, 2])
    result = sample(logits, batch)
    assert result.token_ids[1].item() == -1 and result.token_ids[0].item() >= 0
    assert probabilities(logits, batch)[1].sum().item() == 0.0
    with pytest.raises(ValueError, match="no token can be sampled: all 6 logits are -inf, banned or masked"):
        result.to_host(batch)


def test_nan_or_plus_inf_logits_give_the_rust_samplers_error(rng: np.random.Generator) -> None:
    for bad in (np.nan, np.inf):
        rows = Rows.random(rng, 3, vocab=8, ties=False)
        rows.logits[0, :2] = -np.inf  # -inf is allowed
        rows.logits[2, 5] = bad
        logits, batch = rows.batch(
            [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams()], [0, 1, 2]
        )
        result = sample(logits, batch)
        assert result.token_ids[2].item() == -2 and min(result.token_ids[:2].tolist()) >= 0
        with pytest.raises(ValueError, match="sampling row 2 hold NaN or \\+inf"):
            result.to_host(batch)


def test_bad_batches_are_value_errors() -> None:
    p = SamplingParams()

    def build(**changes):
        args = {"params": [p], "seeds": [0], "prompt_ids": [[0]], "output_ids": [[1]], "banned": [[]]}
        return SamplingBatch.build(**{**args, **changes}, device=DEVICE, vocab_size=4)

    with pytest.raises(ValueError, match="seeds has 2 rows but params has 1"):
        build(seeds=[0, 1])
    with pytest.raises(ValueError, match=r"output_ids\[0\]\[1\] = 4 is not a token id of a vocabulary of 4"):
        build(output_ids=[[1, 4]])
    with pytest.raises(ValueError, match=r"banned\[0\]\[0\] = -1"):
        build(banned=[[-1]])
    with pytest.raises(ValueError, match="seed must be in"):
        build(seeds=[2**64])
    with pytest.raises(ValueError, match=r"logits must be \[1, 4\]"):
        sample(torch.zeros(1, 5, device=DEVICE), build())


def test_the_row_columns_are_what_direct_conversions_give(rng: np.random.Generator) -> None:
    """The per-row columns come over in one float64 table; each is the value and dtype a direct
    ``torch.tensor`` of the column gives (float32 parameters rounded once, from the Python float)."""
    n = 7
    params = [random_params(rng) for _ in range(n)]
    rows = Rows.random(rng, n)
    _, batch = rows.batch(params, seeds_for(rng, n))
    for field, name in [("top_p", "top_p"), ("min_p", "min_p"), ("repetition", "repetition_penalty"),
                        ("frequency", "frequency_penalty"), ("presence", "presence_penalty")]:  # fmt: skip
        want = torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)
        assert torch.equal(getattr(batch, field).cpu(), want), field
    greedy = [np.float32(p.temperature) == 0 or p.top_k == 1 for p in params]
    assert batch.greedy.dtype == torch.bool and batch.greedy.tolist() == greedy
    temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    assert torch.equal(batch.temperature.cpu(), torch.tensor(temperature, dtype=torch.float32))
    assert batch.top_k.dtype == torch.int64 and batch.uniforms.dtype == torch.float64
    assert batch.logprob_index.tolist() == [r for r, p in enumerate(params) if p.logprobs is not None]
    assert batch.logprob_index.dtype == torch.int64


def test_all_greedy_batches_take_the_short_path_to_the_same_draws(rng: np.random.Generator) -> None:
    """``greedy_sample`` (one max, no ``SamplingBatch``) gives what ``sample`` gives a plain greedy
    batch, ties to the lower id, and its errors; any other batch is left to ``sample``."""
    from oxibonsai.runner import SampleRow
    from oxibonsai.torch_backend.sampling import greedy_sample

    def greedy_draws(logits: torch.Tensor, rows: list[SampleRow]) -> object:
        result = greedy_sample(logits, rows)
        return None if result is None else result.send_to_host(logits.shape[-1]).draws()

    def rows_of(params: list[SamplingParams], banned: list[list[int]] | None = None) -> list[SampleRow]:
        banned = banned or [[] for _ in params]
        return [SampleRow(p, 0, None, [1], [2], b) for p, b in zip(params, banned, strict=True)]  # type: ignore[arg-type]

    greedy = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1)] * 3
    logits = torch.from_numpy(rng.integers(-3, 3, (6, 40)).astype(np.float32))  # many ties
    logits[1, :] = float("-inf")
    logits[1, 7] = 2.0
    on_device = logits.to(DEVICE)
    batch = SamplingBatch.build(greedy, [0] * 6, [[1]] * 6, [[2]] * 6, [[]] * 6, DEVICE, vocab_size=40)
    assert greedy_draws(on_device, rows_of(greedy)) == sample(on_device, batch).to_host(batch)
    for value, message in ((float("nan"), "hold NaN"), (float("inf"), "hold NaN or \\+inf")):
        poisoned = logits.clone()
        poisoned[4, 3] = value
        with pytest.raises(ValueError, match=f"sampling row 4 {message}"):
            greedy_draws(poisoned.to(DEVICE), rows_of(greedy))
    nothing = torch.full((6, 40), float("-inf"), device=DEVICE)
    with pytest.raises(ValueError, match="no token can be sampled"):
        greedy_draws(nothing, rows_of(greedy))
    for others in (
        [*greedy[:5], SamplingParams(temperature=0.5)],
        [*greedy[:5], SamplingParams(temperature=0.0, repetition_penalty=1.1)],
        [*greedy[:5], SamplingParams(temperature=0.0, logprobs=2)],
    ):
        assert greedy_draws(on_device, rows_of(others)) is None
    assert greedy_draws(on_device, rows_of(greedy, [[], [], [], [], [], [3]])) is None
    # The engine's flag, worked out once per request, stands for the params' own
    flagged = [dataclasses.replace(r, plain_greedy=False) for r in rows_of(greedy)]
    assert greedy_draws(on_device, flagged) is None

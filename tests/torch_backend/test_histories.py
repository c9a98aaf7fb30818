"""``DeviceHistories``: per-request history rows kept on the device across steps. After any sequence of
steps (outputs growing by a token or several, a request changing its lists, requests finishing and
their slots reused, the tables growing) every row equals the histogram of its request's current
lists; bad ids raise before anything is written; and device sampling with kept rows draws what it
draws from whole-list histograms."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from oxibonsai.sampling_params import SamplingParams  # noqa: E402
from oxibonsai.torch_backend.histories import DeviceHistories  # noqa: E402
from oxibonsai.torch_backend.sampling import SamplingBatch, sample  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 50


def expected_rows(prompt: list[int], output: list[int]) -> tuple[np.ndarray, np.ndarray]:
    seen = np.zeros(VOCAB, dtype=bool)
    seen[prompt + output] = True
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=VOCAB).astype(np.float32)
    return seen, counts


def test_rows_follow_the_requests_lists_through_random_steps(rng):
    kept = DeviceHistories(VOCAB, DEVICE)
    live: dict[int, tuple[list[int], list[int]]] = {}
    next_key = 0
    for _ in range(60):
        # Requests arrive, finish (their slots reused), grow by 0-3 tokens, or change their lists.
        if len(live) < 12 and rng.random() < 0.5:
            live[next_key] = (rng.integers(0, VOCAB, int(rng.integers(0, 20))).tolist(), [])
            next_key += 1
        if live and rng.random() < 0.2:
            key = int(rng.choice(list(live)))
            kept.forget(key)
            del live[key]
        for key, (prompt, output) in list(live.items()):
            roll = rng.random()
            if roll < 0.8:
                output.extend(rng.integers(0, VOCAB, int(rng.integers(0, 4))).tolist())
            elif roll < 0.87:
                live[key] = (prompt, output[: len(output) // 2])  # shorter than counted: rebuilt
            elif roll < 0.94 and output:
                live[key] = (prompt, [*output[:-1], (output[-1] + 1) % VOCAB])  # a token rewritten
            else:
                live[key] = ([*prompt, 1], output)  # another prompt under the key: rebuilt
        if not live:
            continue
        keys = list(rng.permutation(list(live)))
        slots = kept.slots(keys, [live[k][0] for k in keys], [live[k][1] for k in keys])
        assert len(set(slots.tolist())) == len(keys) and len(kept) == len(live)
        for key, slot in zip(keys, slots.tolist(), strict=True):
            seen, counts = expected_rows(*live[key])
            assert (kept.seen[slot].cpu().numpy() == seen).all()
            assert (kept.counts[slot].cpu().numpy() == counts).all()


def test_a_bad_id_raises_and_writes_nothing():
    kept = DeviceHistories(VOCAB, DEVICE)
    kept.slots([1], [[3, 4]], [[5]])
    seen, counts = kept.seen.clone(), kept.counts.clone()
    with pytest.raises(ValueError, match="token id 50 is not a token id of a vocabulary of 50"):
        kept.slots([1, 2], [[3, 4], [1]], [[5, 6], [50]])
    assert torch.equal(kept.seen, seen) and torch.equal(kept.counts, counts) and len(kept) == 1


def test_kept_rows_sample_as_whole_list_histograms(rng):
    """Penalized rows drawn with kept history rows equal those drawn from whole-list histograms."""
    kept = DeviceHistories(VOCAB, DEVICE)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.4, seed=5),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
    ]
    prompts = [rng.integers(0, VOCAB, 10).tolist() for _ in params]
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(6):
        logits = torch.from_numpy(rng.standard_normal((3, VOCAB)).astype(np.float32)).to(DEVICE)
        common = ([p.seed or 0 for p in params], prompts, outputs, [[], [], []])
        whole = SamplingBatch.build(params, *common, DEVICE, vocab_size=VOCAB)
        with_kept = SamplingBatch.build(params, *common, DEVICE, vocab_size=VOCAB, kept=(kept, [7, 8, 9]))
        assert torch.equal(with_kept.seen, whole.seen) and torch.equal(
            with_kept.output_counts, whole.output_counts
        )
        tokens = sample(logits, with_kept).token_ids.tolist()
        assert tokens == sample(logits, whole).token_ids.tolist()
        for output, token in zip(outputs, tokens, strict=True):
            output.append(token)

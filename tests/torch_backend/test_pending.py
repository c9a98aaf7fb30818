"""``pending``: a step's results copied to the host without waiting (``HostCopy``; on CUDA into pinned
memory behind an event) and turned into the engine's draws when read (``PendingDraws``): the values of
the device tensors, even when the kernels that write them are still queued at the copy; the Rust
sampler's errors for rows that got no token."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from oxibonsai.torch_backend.pending import NON_FINITE, NOTHING, HostCopy, PendingDraws  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_host_copies_hold_the_device_values_and_keep_nones(rng):
    ids = torch.from_numpy(rng.integers(0, 1000, 7)).to(DEVICE)
    values = torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32)).to(DEVICE)
    got = HostCopy([ids, None, values]).wait()
    assert got[1] is None
    assert got[0] is not None and got[0].device.type == "cpu" and got[0].tolist() == ids.tolist()
    assert got[2] is not None and torch.equal(got[2], values.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the asynchronous copy needs CUDA")
def test_a_cuda_copy_lands_in_pinned_memory_after_the_kernels_queued_before_it(rng):
    value = int(rng.integers(1, 1000))
    target = torch.zeros(1 << 16, dtype=torch.int64, device=DEVICE)
    torch.cuda._sleep(50_000_000)  # the stream is busy for tens of milliseconds
    target.fill_(value)
    copy = HostCopy([target])
    (host,) = copy.wait()
    assert host is not None and host.is_pinned() and bool((host == value).all())


def test_pending_draws_give_tokens_logprob_rows_and_the_samplers_errors(rng):
    tokens = [int(t) for t in rng.integers(0, 50, 4)]
    lps = torch.tensor([-0.5, -1.25])
    top_ids = torch.tensor([[tokens[1], 3, 4], [tokens[3], 9, 8]])
    tops = torch.tensor([[-0.5, -2.0, -3.0], [-1.25, -1.5, -4.0]])
    copy = HostCopy([torch.tensor(tokens), lps, top_ids, tops, None])
    draws = PendingDraws(copy, 50, (1, 3), (2, 3), torch.tensor(tokens)).draws()
    assert draws[0] == (tokens[0], None, []) and draws[2] == (tokens[2], None, [])
    assert draws[1] == (tokens[1], -0.5, [(tokens[1], -0.5), (3, -2.0)])
    assert draws[3] == (tokens[3], -1.25, [(tokens[3], -1.25), (9, -1.5), (8, -4.0)])
    for code, message in ((NON_FINITE, "sampling row 2 hold NaN"), (NOTHING, "no token can be sampled")):
        bad = torch.tensor([*tokens[:2], code, tokens[3]])
        with pytest.raises(ValueError, match=message):
            PendingDraws(HostCopy([bad, None, None, None, None]), 50, (), (), bad).draws()
    # A greedy result: argmaxes and each row's largest logit, which marks the rows with no token.
    for best, message in (
        (float("nan"), "sampling row 1 hold NaN"),
        (float("-inf"), "no token can be sampled"),
    ):
        maxima = torch.tensor([0.5, best, 2.0, -1.0])
        with pytest.raises(ValueError, match=message):
            PendingDraws(
                HostCopy([torch.tensor(tokens), None, None, None, maxima]), 50, (), (), torch.tensor(tokens)
            ).draws()
    fine = torch.tensor([0.5, 1.0, 2.0, -1.0])
    draws = PendingDraws(
        HostCopy([torch.tensor(tokens), None, None, None, fine]), 50, (), (), torch.tensor(tokens)
    ).draws()
    assert draws == [(t, None, []) for t in tokens]

"""Step results on their way from the device to the host.

``HostCopy`` starts the copies of a step's few small result tensors (sampled ids, requested logprobs, or
the logits for the host's samplers) without waiting for the device: on CUDA into pinned host buffers,
followed by an event on the current stream, so the host goes on while the step still runs (the engine
does the previous step's output work then). ``wait`` blocks until the copies landed and returns the
host tensors. Off CUDA the tensors are read as they are (on the CPU they already live in host memory;
an MPS copy waits). ``PendingDraws`` is a step's sampled ids and logprobs so copied, turned into the
engine's draws when they are read; its ids stay on the device too, for a step planned ahead
(``fed_ids``: the token ids that step takes from them, a ``runner.Feed``). This module never decides
what is copied; the sampling code and the runner do."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from oxibonsai.runner import Draw, Feed

NOTHING = -1
"""The sampled id of a row where every token is ``-inf`` or banned."""
NON_FINITE = -2
"""The sampled id of a row whose logits hold NaN or ``+inf``."""


class HostCopy:
    """Host copies of ``tensors`` (None entries stay None), started now, read with :meth:`wait`."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self._event: torch.cuda.Event | None = None
        cuda = next((t.device for t in tensors if t is not None and t.device.type == "cuda"), None)
        if cuda is None:
            self._host = [None if t is None else t.to("cpu") for t in tensors]
            return
        self._host = [None if t is None else _pinned_copy(t) for t in tensors]
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(cuda))

    def wait(self) -> list[torch.Tensor | None]:
        """The host tensors, once every copy has landed (blocks on the device's stream if needed)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of CUDA tensor ``t`` into a new pinned host tensor, queued on the current stream: the
    host may read it only after an event recorded behind it has completed."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class PendingDraws:
    """One step's draws on their way to the host; :meth:`draws` waits for them (the only wait)."""

    def __init__(
        self,
        copy: HostCopy,
        vocab_size: int,
        logprob_rows: tuple[int, ...],
        logprob_counts: tuple[int, ...],
        device_ids: torch.Tensor,
    ) -> None:
        self._copy = copy
        self.device_ids = device_ids  # int64 [R] on the device: the sampled ids a step planned ahead takes
        self._vocab_size = vocab_size
        self._logprob_rows = logprob_rows
        self._logprob_counts = logprob_counts

    def draws(self) -> list[Draw]:
        """Per row ``(token, raw logprob or None, [(id, raw logprob)] * n)``, what
        ``_core.Sampler.sample`` returns; raises its ValueError for a row with nothing to sample or with
        NaN or ``+inf`` logits."""
        token_ids, logprobs, top_ids, top_logprobs, best = self._copy.wait()
        assert token_ids is not None
        tokens = token_ids.tolist() if best is None else _greedy_codes(token_ids, best)
        _raise_for_missing(tokens, self._vocab_size)
        draws: list[Draw] = [(token, None, []) for token in tokens]
        if logprobs is None or top_ids is None or top_logprobs is None:
            return draws
        rows = zip(self._logprob_rows, self._logprob_counts, strict=True)
        lps, ids, tops = logprobs.tolist(), top_ids.tolist(), top_logprobs.tolist()
        for j, (r, n) in enumerate(rows):
            draws[r] = (tokens[r], lps[j], list(zip(ids[j][:n], tops[j][:n], strict=True)))
        return draws


def _greedy_codes(argmax: torch.Tensor, best: torch.Tensor) -> list[int]:
    """Argmax ids with the codes of rows that got no token, read from each row's largest logit: NaN or
    ``+inf`` (NaN propagates through the max) -> ``NON_FINITE``, ``-inf`` -> ``NOTHING``."""
    tokens: list[int] = argmax.tolist()
    maxima = best.float().numpy()
    if np.isfinite(maxima).all():
        return tokens
    for row in np.flatnonzero(~np.isfinite(maxima)):
        tokens[row] = NOTHING if maxima[row] == -np.inf else NON_FINITE
    return tokens


def _raise_for_missing(tokens: list[int], vocab: int) -> None:
    """The Rust sampler's ValueError for the first row that got no token, if any."""
    if NON_FINITE in tokens:
        row = tokens.index(NON_FINITE)
        raise ValueError(f"the logits of sampling row {row} hold NaN or +inf; logits must be finite or -inf")
    if NOTHING in tokens:
        raise ValueError(f"no token can be sampled: all {vocab} logits are -inf, banned or masked")


def fed_ids(feed: Feed) -> torch.Tensor:
    """int64 ``[len(feed.rows)]`` on the device: the ids a step planned ahead takes from the step
    before it (``feed.draws``, that step's ``PendingDraws``). A row that got no token there (-1 or -2:
    its step fails when its draws are read) reads id 0, so the step ahead never indexes outside the
    embedding."""
    if not isinstance(feed.draws, PendingDraws):
        raise ValueError("a step planned ahead takes its ids from a step sampled on the device")
    ids = feed.draws.device_ids
    if feed.rows != list(range(len(feed.rows))):
        ids = ids[torch.tensor(feed.rows, dtype=torch.int64).to(ids.device, non_blocking=True)]
    else:
        ids = ids[: len(feed.rows)]
    return ids.clamp(min=0)

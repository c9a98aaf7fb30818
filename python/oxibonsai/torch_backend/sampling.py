"""Sampling on the device: one step's logit rows in, one token per row out; only token ids and the
requested logprobs cross to the host.

``sampling_batch.SamplingBatch.build`` turns each row's ``SamplingParams``, seed, history and banned ids
into tensors on the logits' device (re-exported here with ``draw_uniform``). ``sample`` then runs the
Rust sampler's pipeline (``rust/core/src/sample``) on all rows at once, in a number of kernel launches
set by which features the batch uses, never by its size: the logit biases, repetition penalty over
prompt and output ids, frequency and presence penalties over output ids, banned ids to ``-inf``;
greedy rows (temperature 0 or top-k 1) take the first maximum; the others temperature -> top-k ->
top-p -> min-p and one inverse-CDF draw over the candidates in ascending id, the walk the Rust sampler
makes. Logprobs are the *raw* ``log_softmax`` of the logits as given (before biases, penalties,
temperature and filters), the top ones descending with ties to the lower id.

A row's one uniform is a counter-based hash of (seed, step), step being the row's own token index (its
output length by default), computed on the host when the batch is built. A row's token therefore depends
on its logits, history, parameters, seed and step only, never on the other rows or their number. This
is not the Rust sampler's random stream (xoshiro, one draw per token), so the tokens differ from the CPU
path's, but the distribution is the same.

This module never synchronizes with the device except in ``PendingDraws.draws`` (``SampleResult.to_host``
starts the copies and waits; ``send_to_host`` only starts them). A row whose logits hold NaN or
``+inf`` gets no token: ``draws`` raises ValueError for it, as the Rust sampler does.

``start_sampling`` is what the torch runner calls: the engine's ``SampleRow``s in, their draws on the
way out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from oxibonsai.runner import Draw
from oxibonsai.torch_backend.histories import DeviceHistories
from oxibonsai.torch_backend.pending import NON_FINITE, NOTHING, HostCopy, PendingDraws
from oxibonsai.torch_backend.sampling_batch import F32_MAX, SamplingBatch, draw_uniform

__all__ = ["SampleResult", "SamplingBatch", "draw_uniform", "greedy_sample", "probabilities", "sample",
           "start_sampling"]  # fmt: skip

if TYPE_CHECKING:
    from oxibonsai.runner import SampleRow

_EXP_FLOOR = -87.0
"""The Rust sampler's exp is exactly 0 below this argument (``math.rs``), so such tokens have no weight."""


@dataclass(frozen=True)
class SampleResult:
    """One step's draws, on the device. Logprob tensors have one row per ``batch.logprob_rows`` entry
    (None when no row asked); row j's top list is the first ``batch.logprob_counts[j]`` columns."""

    token_ids: torch.Tensor  # int64 [R]; -1 where every token is -inf or banned, -2 on NaN or +inf
    logprobs: torch.Tensor | None  # float32 [L]: the raw logprob of the row's token
    top_ids: torch.Tensor | None  # int64 [L, N]: highest raw logprobs first, ties to the lower id
    top_logprobs: torch.Tensor | None  # float32 [L, N]
    # float [R]: each row's largest logit, where the host tells the rows with no token (the -1 and -2
    # above) from it and ``token_ids`` holds plain argmaxes (``greedy_sample``: fewer launches)
    best: torch.Tensor | None = None

    def to_host(self, batch: SamplingBatch) -> list[Draw]:
        """Per row what ``_core.Sampler.sample`` returns: ``(token, raw logprob or None, [(id, raw
        logprob)] * n)``; raises its ValueError for a row with nothing to sample or with NaN or
        ``+inf`` logits. Synchronizes."""
        return self.send_to_host(batch.vocab_size, batch.logprob_rows, batch.logprob_counts).draws()

    def send_to_host(
        self, vocab_size: int, logprob_rows: Sequence[int] = (), logprob_counts: Sequence[int] = ()
    ) -> PendingDraws:
        """Starts the copies to the host without waiting for the device (see ``PendingDraws``)."""
        copy = HostCopy([self.token_ids, self.logprobs, self.top_ids, self.top_logprobs, self.best])
        return PendingDraws(copy, vocab_size, tuple(logprob_rows), tuple(logprob_counts), self.token_ids)


def greedy_sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult | None:
    """The result of a batch whose every row is plain greedy (temperature 0 or top-k 1; no penalty, no
    banned id, no logprobs), what ``sample`` gives it, from one max over the vocabulary (one launch),
    with no ``SamplingBatch`` built: the host reads the rows that got no token from the maxima it
    copies too. None for any other batch."""
    if not all(_plain_greedy(r) for r in rows):
        return None
    best, index = logits.max(dim=-1)  # NaN propagates; ties go to the lower id
    return SampleResult(index, None, None, None, best)


def _plain_greedy(row: SampleRow) -> bool:
    plain = row.plain_greedy if row.plain_greedy is not None else row.params.is_plain_greedy
    return plain and not row.banned and row.allowed is None


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """One token per row of ``logits`` (float32 [R, V], on the batch's device), and the logprobs the
    rows asked for, without leaving the device."""
    x, best, valid, first_max = _prepare(logits, batch)
    token = first_max
    if not batch.all_greedy:
        ids, weights = _candidates(x, best, batch)
        token = torch.where(batch.greedy, first_max, _draw(ids, weights, batch.uniforms))
    token = token.masked_fill(~valid, NOTHING)
    non_finite = (torch.isnan(logits) | (logits == float("inf"))).any(-1)
    token = token.masked_fill(non_finite, NON_FINITE)
    return SampleResult(token, *_logprobs(logits.float(), token, batch))


def start_sampling(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    vocab_size: int,
    kept: DeviceHistories | None = None,
    pending_ids: torch.Tensor | None = None,
) -> PendingDraws:
    """One step's draws for the engine's sampling rows (``logits``: [R, V] on the device), started: the
    batch is built and sampled, and only the token ids and requested logprobs head for the host, without
    waiting for the device (``PendingDraws.draws`` waits). ``kept``: the runner's ``DeviceHistories``,
    keyed by each row's ``key``, for the penalties (not used when a row has no key, -1).
    ``pending_ids``: in a step launched ahead, each row's token sampled by the step before it, which
    its ``output_ids`` does not hold yet (the penalties count it, and a row's random draw is that of
    the token after it)."""
    greedy = greedy_sample(logits, rows)
    if greedy is not None:
        return greedy.send_to_host(vocab_size)
    batch = SamplingBatch.build(
        [r.params for r in rows],
        [r.seed for r in rows],
        [r.prompt_ids for r in rows],
        [r.output_ids for r in rows],
        [r.banned for r in rows],
        logits.device,
        vocab_size=vocab_size,
        # A row ahead draws the token after the one in flight: its random draw is keyed by that index.
        steps=None if pending_ids is None else [len(r.output_ids) + 1 for r in rows],
        kept=None if kept is None or any(r.key < 0 for r in rows) else (kept, [r.key for r in rows]),
        pending_ids=pending_ids,
        allowed=[r.allowed for r in rows],
    )
    return sample(logits, batch).send_to_host(batch.vocab_size, batch.logprob_rows, batch.logprob_counts)


def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The float32 [R, V] distributions ``sample`` draws from (``Sampler.probabilities``): zero outside
    the candidates, one-hot on greedy rows, all zero where nothing can be sampled."""
    x, best, valid, first_max = _prepare(logits, batch)
    probs = torch.zeros_like(x)
    if not batch.all_greedy:
        ids, weights = _candidates(x, best, batch)
        w = weights.double()
        normalized = (w / w.sum(-1, keepdim=True)).float()
        probs = normalized if ids is None else probs.scatter(1, ids, normalized)
    one_hot = torch.zeros_like(x).scatter_(1, first_max[:, None], 1.0)
    return torch.where(batch.greedy[:, None], one_hot, probs).masked_fill(~valid[:, None], 0.0)


def _prepare(
    logits: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The penalized logits, their row maxima (0 where a row has nothing to sample, so that no NaN
    appears), whether each row has a token to sample, and the first position of each maximum."""
    if logits.dim() != 2 or tuple(logits.shape) != (batch.num_rows, batch.vocab_size):
        raise ValueError(f"logits must be [{batch.num_rows}, {batch.vocab_size}], got {list(logits.shape)}")
    x = _penalized(logits.float(), batch)
    best, first_max = x.max(dim=-1)  # torch returns the first index of a maximum: ties to the lower id
    valid = best > float("-inf")
    return x, best.masked_fill(~valid, 0.0), valid, first_max


def _penalized(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``bias.rs``: the logit biases; ``penalties.rs``: repetition (divide positive, multiply
    non-positive logits) once per id seen in prompt or output; then ``logit -= frequency * count +
    presence`` per id in the output; each result saturated below ``+inf``; then banned ids to
    ``-inf``. Neutral parameters leave a row's bits as they are, so rows without penalties share these
    kernels unchanged."""
    if batch.bias is not None:
        x = batch.bias.apply(x)
    if batch.seen is not None:
        rep = batch.repetition[:, None]
        x = torch.where(batch.seen, torch.where(x > 0, x / rep, x * rep).clamp_max(F32_MAX), x)
    if batch.output_counts is not None:
        counts = batch.output_counts
        penalty = batch.frequency[:, None] * counts + batch.presence[:, None]
        x = torch.where(counts > 0, (x - penalty).clamp_max(F32_MAX), x)
    if batch.banned is not None:
        x = x.masked_fill(batch.banned, float("-inf"))
    return x


def _weights(x: torch.Tensor, best: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``exp((x - max) / temperature)`` as ``filters::weights`` computes it (float32; the best token
    weighs exactly 1), zero below the Rust exp's floor."""
    arg = (x - best[:, None]) / batch.temperature[:, None]
    return arg.exp().masked_fill_(arg < _EXP_FLOOR, 0.0)


def _candidates(
    x: torch.Tensor, best: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The draw's weights, zero outside the candidates, in ascending id order: over the ids returned
    ([R, K], when every sampled row ranks and keeps at most K < V) or over the whole vocabulary (None)."""
    if batch.rank_width == 0:
        return None, _min_p(_weights(x, best, batch), batch)
    ids, ranked = _ranked_candidates(x, best, batch)
    if batch.rank_width < batch.vocab_size and not batch.unranked_rows:
        order = ids.argsort(dim=-1)
        return ids.gather(1, order), ranked.gather(1, order)
    scattered = torch.zeros_like(x).scatter_(1, ids, ranked)
    if not batch.unranked_rows:
        return None, scattered
    return None, torch.where(batch.ranked[:, None], scattered, _min_p(_weights(x, best, batch), batch))


def _min_p(w: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Min-p over weights relative to the best token's 1 (the rows that rank apply it themselves)."""
    return w.masked_fill(w < batch.min_p[:, None], 0.0) if batch.any_min_p else w


def _ranked_candidates(
    x: torch.Tensor, best: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, top-p and min-p (``filters.rs``) over each row's ``rank_width`` highest penalized logits,
    highest first: the ids and their weights, zero where filtered out. Top-p keeps the tokens whose mass
    ahead of them (float64) is below ``top_p`` times the top-k set's mass, and, as the Rust sampler does
    before its selection, none lighter than its cut ``(1 - top_p) z / 2k`` or than ``min_p``."""
    width = batch.rank_width
    ids = _ranked(x, width)
    w = _weights(x.gather(1, ids), best, batch)
    k = batch.top_k[:, None]
    w = w.masked_fill(torch.arange(width, device=x.device) >= k, 0.0)
    w64 = w.double()
    z = w64.sum(-1, keepdim=True)
    ahead = F.pad(w64.cumsum(-1)[:, :-1], (1, 0))
    top_p = batch.top_p.double()[:, None]
    by_p = top_p < 1
    min_p = batch.min_p[:, None]
    cut = (0.5 * (1 - top_p) * z / k).float()
    floor = torch.where(by_p, torch.maximum(cut, min_p), min_p)
    keep = (w >= floor) & (~by_p | (ahead < top_p * z))
    return ids, w.masked_fill(~keep, 0.0)


def _ranked(x: torch.Tensor, width: int) -> torch.Tensor:
    """The ids of each row's ``width`` largest values, largest first, ties to the lower id (``rank.rs``;
    ``-0.0`` ties with ``0.0``): ``topk`` over int64 keys that order by value and then by id, since
    ``topk`` itself breaks ties in no documented order."""
    vocab = x.shape[-1]
    bits = (x + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # signed order = float order
    shift = max(1, (vocab - 1).bit_length())
    keys = ordered * (1 << shift) + ((1 << shift) - 1 - torch.arange(vocab, device=x.device))
    return torch.topk(keys, width, dim=-1, sorted=True).indices


def _draw(ids: torch.Tensor | None, w: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``sampler.rs``'s draw: walking the candidates in ascending id, the first whose running weight
    (float64) exceeds ``u * total``; the last weighted one if rounding puts the target at the total."""
    cdf = w.double().cumsum(-1)
    target = uniforms * cdf[:, -1]
    pos = (cdf <= target[:, None]).sum(-1)
    last = ((w > 0) * torch.arange(w.shape[-1], device=w.device)).amax(-1)
    pos = torch.minimum(pos, last)
    return pos if ids is None else ids.gather(1, pos[:, None]).squeeze(1)


def _logprobs(
    logits: torch.Tensor, token: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``logprobs.rs`` for the rows that asked: the raw logprob of each row's token and its top ones,
    against a float64 log-normalizer of the unprocessed logits."""
    if not batch.logprob_rows:
        return None, None, None
    raw = logits.index_select(0, batch.logprob_index)
    lse = torch.logsumexp(raw.double(), dim=-1, keepdim=True)
    chosen = token.index_select(0, batch.logprob_index).clamp_min(0)[:, None]
    logprob = (raw.gather(1, chosen).double() - lse).squeeze(1).float()
    top_ids = _ranked(raw, min(max(batch.logprob_counts), batch.vocab_size))
    top = (raw.gather(1, top_ids).double() - lse).float()
    return logprob, top_ids, top

"""``SamplingBatch``: one step's sampling rows as tensors on the logits' device, for ``sampling``'s
kernels. ``SamplingBatch.build`` turns each row's ``SamplingParams``, seed, histories and banned ids
into them, with the only loop over rows: the per-row columns travel to the device as one table in one
copy, the histories as masks and counts (or from the runner's ``DeviceHistories``). It checks what it
is given (seeds, steps, ids against the vocabulary) and never samples.

A row's one uniform (``draw_uniform``) is a counter-based hash of (seed, step), step being the row's
own token index, so a row's draw depends on nothing but the row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from oxibonsai.torch_backend.histories import DeviceHistories

if TYPE_CHECKING:
    from oxibonsai.sampling_params import SamplingParams

_MASK64 = 2**64 - 1
F32_MAX = float(np.finfo(np.float32).max)
"""Where biased and penalized logits saturate, below ``+inf`` (as the Rust sampler's do)."""
_SEED_LIMIT = 2**64


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit words whose outputs look independent."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) (53 random bits) of a row with ``seed`` at token index ``step``: the
    ``step``-th output of a SplitMix64 stream keyed by the mixed seed."""
    z = _mix64((_mix64(seed) + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64)
    return (z >> 11) * 2.0**-53


@dataclass(frozen=True)
class SamplingBatch:
    """``R`` rows' sampling parameters and histories as tensors on one device (built by :meth:`build`).

    The host fields (``vocab_size`` and after ``uniforms``) choose which kernels run; they describe the
    batch's mix of features, so the kernel count never depends on ``R``."""

    vocab_size: int
    greedy: torch.Tensor  # bool [R]: temperature 0 or top-k 1 (argmax, no draw)
    temperature: torch.Tensor  # float32 [R] (1 on greedy rows, where it is never read)
    top_k: torch.Tensor  # int64 [R]: how many tokens top-k keeps (vocab_size when off)
    top_p: torch.Tensor  # float32 [R]
    min_p: torch.Tensor  # float32 [R]
    repetition: torch.Tensor  # float32 [R]
    frequency: torch.Tensor  # float32 [R]
    presence: torch.Tensor  # float32 [R]
    seen: torch.Tensor | None  # bool [R, V]: in prompt or output (None: no repetition penalty)
    output_counts: torch.Tensor | None  # float32 [R, V]: occurrences in output (None: no freq/presence)
    banned: torch.Tensor | None  # bool [R, V] (None: nothing banned)
    bias: LogitBias | None  # every row's logit bias (None: no row has one)
    ranked: torch.Tensor  # bool [R]: a sampled row with top-k or top-p on
    uniforms: torch.Tensor  # float64 [R]: draw_uniform(seed, step)
    logprob_index: torch.Tensor  # int64 [L]: logprob_rows on the device
    logprob_rows: tuple[int, ...]  # the rows that asked for logprobs, ascending
    logprob_counts: tuple[int, ...]  # how many top logprobs each of them asked for
    rank_width: int  # candidates ranked for top-k/top-p: max top_k of ranked rows (0: none ranked)
    unranked_rows: bool  # whether some sampled row has neither top-k nor top-p
    all_greedy: bool
    any_min_p: bool

    @property
    def num_rows(self) -> int:
        return int(self.greedy.shape[0])

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        banned: Sequence[Sequence[int]],
        device: torch.device | str,
        *,
        vocab_size: int,
        steps: Sequence[int] | None = None,
        kept: tuple[DeviceHistories, Sequence[int]] | None = None,
        pending_ids: torch.Tensor | None = None,
        allowed: Sequence[np.ndarray | None] | None = None,
    ) -> SamplingBatch:
        """The batch of rows ``params[r]`` with ``seeds[r]`` (the request's seed, or the engine's when it
        has none), its histories and the ids it must not sample now. ``steps[r]`` keys row r's random
        draw (default: its output length, the index of the token being sampled). ``kept``: the
        penalties' history rows come from these ``DeviceHistories`` under these request keys (only
        the ids they add are read and checked), not from histograms of the whole lists.
        ``pending_ids`` (int64 ``[R]`` on the device): each row's output token that ``output_ids`` does
        not hold yet (a step launched ahead of it), added to the penalties' histories of this batch.
        ``allowed[r]``: row r's structured-output allow-bitmask (int32 words, one bit per id; None:
        every id), unpacked on the device into the banned mask."""
        steps = [len(o) for o in output_ids] if steps is None else steps
        histories = {"prompt_ids": prompt_ids, "output_ids": output_ids, "banned": banned}
        _check_rows(params, seeds, steps, histories, vocab_size, whole_lists=kept is None)
        f32 = np.float32
        greedy = [f32(p.temperature) == 0 or p.top_k == 1 for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        ranked = [
            not g and (k < vocab_size or f32(p.top_p) < 1)
            for p, g, k in zip(params, greedy, top_k, strict=True)
        ]
        sampled = [not g for g in greedy]
        logprob_rows = tuple(r for r, p in enumerate(params) if p.logprobs is not None)
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        uniforms = [draw_uniform(s, t) for s, t in zip(seeds, steps, strict=True)]
        rows = _upload_rows(
            {
                "greedy": greedy,
                "ranked": ranked,
                "top_k": top_k,
                "logprob_index": [*logprob_rows, *[-1] * (len(params) - len(logprob_rows))],
                "uniforms": uniforms,
                "temperature": temperature,
                **{name: [getattr(p, param) for p in params] for name, param in _FLOAT_PARAMS.items()},
            },
            device,
        )
        floats = rows["temperature":].float()  # one conversion for every float32 column
        seen, output_counts, banned_mask = _history_masks(params, histories, vocab_size, device, kept)
        banned_mask = _with_disallowed(banned_mask, allowed, vocab_size, device)
        bias = LogitBias.build(params, vocab_size, device)
        if pending_ids is not None:
            _add_pending(seen, output_counts, pending_ids)
        return cls(
            vocab_size=vocab_size,
            greedy=rows["greedy"] != 0,
            temperature=floats[0],
            top_k=rows["top_k"].long(),
            **{name: floats[i + 1] for i, name in enumerate(_FLOAT_PARAMS)},
            seen=seen,
            output_counts=output_counts,
            banned=banned_mask,
            bias=bias,
            ranked=rows["ranked"] != 0,
            uniforms=rows["uniforms"],
            logprob_index=rows["logprob_index"][: len(logprob_rows)].long(),
            logprob_rows=logprob_rows,
            logprob_counts=tuple(int(params[r].logprobs or 0) for r in logprob_rows),
            rank_width=max((k for k, rank in zip(top_k, ranked, strict=True) if rank), default=0),
            unranked_rows=any(s and not rank for s, rank in zip(sampled, ranked, strict=True)),
            all_greedy=not any(sampled),
            any_min_p=any(f32(p.min_p) > 0 for p, s in zip(params, sampled, strict=True) if s),
        )


@dataclass(frozen=True)
class LogitBias:
    """The batch's logit biases as three columns on the device, one entry per (row, token id) with an
    amount: ``x[rows, ids] += amounts`` (``bias.rs``)."""

    rows: torch.Tensor  # int64 [B]
    ids: torch.Tensor  # int64 [B]
    amounts: torch.Tensor  # float32 [B]: the Python floats rounded to float32, as the Rust sampler's

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], vocab: int, device: torch.device | str
    ) -> LogitBias | None:
        """None when no row has a bias; raises the Rust sampler's ValueError for an id outside the
        vocabulary."""
        entries = [(r, t, a) for r, p in enumerate(params) for t, a in (p.logit_bias or {}).items()]
        if not entries:
            return None
        bad = next(((r, t) for r, t, _ in entries if t >= vocab), None)
        if bad is not None:
            raise ValueError(
                f"row {bad[0]}: logit_bias token {bad[1]} is not a token id of a vocabulary of {vocab}"
            )
        table = torch.tensor(entries, dtype=torch.float64).T.to(device)  # ids < 2^32: exact in float64
        return cls(table[0].long(), table[1].long(), table[2].float())

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float32 [R, V]) with the amounts added, each sum kept below ``+inf``; a new tensor."""
        biased = (x[self.rows, self.ids] + self.amounts).clamp_max(F32_MAX)
        return x.index_put((self.rows, self.ids), biased)


_FLOAT_PARAMS = {  # SamplingBatch field -> SamplingParams field, the float32 columns after temperature
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition": "repetition_penalty",
    "frequency": "frequency_penalty",
    "presence": "presence_penalty",
}


class _Rows:
    """Per-row columns uploaded as one float64 table (one host-to-device copy per step, not one per
    column): ``rows[name]`` is that column, ``rows[name:]`` it and every column after it. float64
    holds every value exactly: flags, ids and top-k below 2^53, the uniforms' 53-bit values, and the
    parameters, which are Python floats rounded to float32 on the device as on the host."""

    def __init__(self, names: list[str], table: torch.Tensor) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        self.table = table

    def __getitem__(self, key: str | slice) -> torch.Tensor:
        if isinstance(key, slice):
            return self.table[self.index[key.start] :]
        return self.table[self.index[key]]


def _upload_rows(columns: dict[str, Sequence[float]], device: torch.device | str) -> _Rows:
    table = torch.from_numpy(np.array(list(columns.values()), dtype=np.float64).reshape(len(columns), -1))
    return _Rows(list(columns), table.to(device))


def _check_rows(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    steps: Sequence[int],
    histories: dict[str, Sequence[Sequence[int]]],
    vocab: int,
    *,
    whole_lists: bool,
) -> None:
    """Raises ValueError unless every column has a row per ``params``, every id is a token id (the
    banned ids, and with ``whole_lists`` the prompts and outputs too), every seed fits 64 bits and
    every step is >= 0 (the Rust sampler's checks, made once per batch)."""
    for name, column in {"seeds": seeds, "steps": steps, **histories}.items():
        if len(column) != len(params):
            raise ValueError(f"{name} has {len(column)} rows but params has {len(params)}")
    if vocab < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab}")
    for name, rows in histories.items():
        if whole_lists or name == "banned":
            _check_ids(rows, name, vocab)
    for r, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
        if not (0 <= seed < _SEED_LIMIT and step >= 0):
            raise ValueError(f"row {r}: seed must be in [0, 2**64) and step >= 0, got {seed}, {step}")


def _history_masks(
    params: Sequence[SamplingParams],
    histories: dict[str, Sequence[Sequence[int]]],
    vocab: int,
    device: torch.device | str,
    kept: tuple[DeviceHistories, Sequence[int]] | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``seen``, ``output_counts`` and ``banned`` of :class:`SamplingBatch`, each None where no row of
    the batch needs it."""
    f32 = np.float32
    prompt_ids, output_ids, banned = histories["prompt_ids"], histories["output_ids"], histories["banned"]
    repetition = any(f32(p.repetition_penalty) != 1 for p in params)
    counted = any(f32(p.frequency_penalty) != 0 or f32(p.presence_penalty) != 0 for p in params)
    seen = output_counts = banned_mask = None
    if kept is not None and (repetition or counted):
        rows, keys = kept
        slots = rows.slots(keys, prompt_ids, output_ids)
        seen = rows.seen.index_select(0, slots) if repetition else None
        output_counts = rows.counts.index_select(0, slots) if counted else None
    else:
        if repetition:
            history = [[*p, *o] for p, o in zip(prompt_ids, output_ids, strict=True)]
            seen = _histogram(history, vocab, device) > 0
        if counted:
            output_counts = _histogram(output_ids, vocab, device)
    if any(banned):
        banned_mask = _histogram(banned, vocab, device) > 0
    return seen, output_counts, banned_mask


def _with_disallowed(
    banned: torch.Tensor | None,
    allowed: Sequence[np.ndarray | None] | None,
    vocab: int,
    device: torch.device | str,
) -> torch.Tensor | None:
    """``banned`` (bool [R, V] or None) with every id a row's allow-bitmask leaves out: the words go
    to the device (4 bytes per 32 ids) and are unpacked there."""
    if allowed is None or all(a is None for a in allowed):
        return banned
    words = (vocab + 31) // 32
    table = np.full((len(allowed), words), -1, dtype=np.int32)
    for r, mask in enumerate(allowed):
        if mask is not None:
            if mask.shape != (words,):
                raise ValueError(f"row {r}: the token mask has shape {mask.shape}; {vocab} ids need {words}")
            table[r] = mask
    bits = torch.arange(32, dtype=torch.int32, device=device)
    packed = torch.from_numpy(table).to(device)
    disallowed = ((packed.unsqueeze(-1) >> bits) & 1).reshape(len(allowed), -1)[:, :vocab] == 0
    return disallowed if banned is None else banned | disallowed


def _add_pending(seen: torch.Tensor | None, counts: torch.Tensor | None, ids: torch.Tensor) -> None:
    """Row r's output token ``ids[r]`` into this batch's ``seen`` and ``counts`` (their rows are
    copies: a ``DeviceHistories`` row takes the token from the request's list once it holds it)."""
    rows = torch.arange(ids.shape[0], device=ids.device)
    if seen is not None:
        seen[rows, ids] = True
    if counts is not None:
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)


def _check_ids(rows: Sequence[Sequence[int]], name: str, vocab: int) -> None:
    """Raises ValueError naming the first id outside ``[0, vocab)`` (the Rust sampler's check)."""
    for r, ids in enumerate(rows):
        array = np.asarray(ids, dtype=np.int64)
        bad = np.flatnonzero((array < 0) | (array >= vocab))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{r}][{i}] = {array[i]} is not a token id of a vocabulary of {vocab}")


def _histogram(rows: Sequence[Sequence[int]], vocab: int, device: torch.device | str) -> torch.Tensor:
    """How often each id occurs in each row, float32 [R, V]: one scatter-add of the ids padded with
    ``vocab`` (a bin that is then dropped)."""
    width = max((len(ids) for ids in rows), default=0)
    padded = np.full((len(rows), width), vocab, dtype=np.int64)
    for r, ids in enumerate(rows):
        padded[r, : len(ids)] = ids
    index = torch.from_numpy(padded).to(device)
    counts = torch.zeros((len(rows), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]

"""The step plan the torch model runs: ``StepBatch`` (numpy arrays, as the Rust scheduler hands them
over) and ``DeviceBatch`` (the same arrays as torch tensors on the model's device).

A step is a flat run of ``T`` new tokens from ``S`` sequences (prefill, chunked prefill and decode are
all "n tokens of sequence s"). Sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s+1]``; its
KV length after the step is ``seq_lens[s]``; its tokens' K/V go to ``slot_mapping`` (``block * 16 +
offset``) and attention reads them back through ``block_tables[s]``. Only the rows in
``logits_indices`` reach the LM head. Rows at positions ``>= decode_from[s]`` are tokens the request
sampled (``decode_from`` is its prompt's length): attention computes them as decode rows, as when each
was first computed alone, also when a preempted request recomputes them in one piece.

This module owns the layout of that plan and nothing else: it never runs a model, never allocates KV
blocks (the Rust core does) and imports torch only inside ``to_device``, so it can be imported without
torch."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from oxibonsai.runner import BLOCK_TOKENS

if TYPE_CHECKING:
    import torch

"""Tokens per KV block: the Rust core's block size and the pool's second dimension."""

LogitRows = Literal["none", "last", "all"]
# (block_table, context_len, new_tokens, want_logits), optionally with decode_from last
SequenceStep = (
    tuple[Sequence[int], int, Sequence[int], bool | LogitRows]
    | tuple[Sequence[int], int, Sequence[int], bool | LogitRows, int]
)

# name -> (dtype, ndim) of every field, in declaration order (shared by StepBatch and DeviceBatch).
FIELD_LAYOUT: dict[str, tuple[type[np.integer[Any]], int]] = {
    "input_ids": (np.int32, 1),
    "positions": (np.int32, 1),
    "slot_mapping": (np.int64, 1),
    "query_start_loc": (np.int32, 1),
    "seq_lens": (np.int32, 1),
    "block_tables": (np.int32, 2),
    "logits_indices": (np.int32, 1),
    "decode_from": (np.int32, 1),
}


@dataclass(frozen=True)
class StepBatch:
    """One step's plan as numpy arrays (``T`` tokens, ``S`` sequences, ``R`` logit rows)."""

    input_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int64 [T]: block * 16 + offset
    query_start_loc: np.ndarray  # int32 [S+1]
    seq_lens: np.ndarray  # int32 [S]: KV length after the step
    block_tables: np.ndarray  # int32 [S, max_blocks], padded with 0
    logits_indices: np.ndarray  # int32 [R]: rows of T whose logits are returned, in order
    decode_from: np.ndarray  # int32 [S]: the first position of the sequence's sampled tokens

    def __post_init__(self) -> None:
        """Checks dtypes and how the lengths fit together (cheap; the values are the core's)."""
        for name, (dtype, ndim) in FIELD_LAYOUT.items():
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != ndim:
                got = (
                    f"{array.dtype} {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
                )
                raise ValueError(f"StepBatch.{name} must be a {ndim}-D {np.dtype(dtype)} array, got {got}")
        t, s = self.input_ids.shape[0], self.seq_lens.shape[0]
        if self.positions.shape[0] != t or self.slot_mapping.shape[0] != t:
            raise ValueError("StepBatch: input_ids, positions and slot_mapping differ in length")
        if self.query_start_loc.shape[0] != s + 1 or self.block_tables.shape[0] != s:
            raise ValueError("StepBatch: query_start_loc needs S+1 entries and block_tables S rows")
        if self.decode_from.shape[0] != s:
            raise ValueError("StepBatch: decode_from needs one entry per sequence")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def for_sequences(cls, seqs: Sequence[SequenceStep]) -> StepBatch:
        """A plan from ``(block_table, context_len, new_tokens, want_logits[, decode_from])`` per
        sequence: ``context_len`` tokens are already in the KV blocks, ``new_tokens`` run now at the
        following positions. ``want_logits``: ``True`` (or ``"all"``) returns every new row's logits,
        as ``LLM.logits`` needs; ``"last"`` the last row only, as sampling needs; ``False``/``"none"``
        none. ``decode_from`` (the prompt's length) defaults to ``default_decode_from``'s rule."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        plans = [_plan_sequence(i, *seq) for i, seq in enumerate(seqs)]
        starts = np.cumsum([0] + [len(p.positions) for p in plans])
        width = max(len(p.block_table) for p in plans)
        tables = np.zeros((len(plans), width), dtype=np.int32)
        for row, p in zip(tables, plans, strict=True):
            row[: len(p.block_table)] = p.block_table
        logit_rows = [start + p.logit_rows for start, p in zip(starts[:-1], plans, strict=True)]
        seq_lens = np.array([p.seq_len for p in plans], dtype=np.int32)
        decode_from = default_decode_from(starts, seq_lens)
        for i, p in enumerate(plans):
            if p.decode_from is not None:
                decode_from[i] = p.decode_from
        return cls(
            input_ids=np.concatenate([p.tokens for p in plans]).astype(np.int32),
            positions=np.concatenate([p.positions for p in plans]).astype(np.int32),
            slot_mapping=np.concatenate([p.slots for p in plans]).astype(np.int64),
            query_start_loc=starts.astype(np.int32),
            seq_lens=seq_lens,
            block_tables=tables,
            logits_indices=np.concatenate(logit_rows).astype(np.int32),
            decode_from=decode_from,
        )

    @classmethod
    def from_plan(cls, plan: Any) -> StepBatch:
        """The arrays of a ``_core.StepPlan`` (``Scheduler.prepare``), shared, not copied."""
        return cls(**{name: getattr(plan, name) for name in FIELD_LAYOUT})

    @property
    def max_query_len(self) -> int:
        """The most new tokens any sequence has in this step (1 for a pure decode step)."""
        return int(np.diff(self.query_start_loc).max()) if self.seq_lens.shape[0] else 0

    def decode_rows(self) -> np.ndarray:
        """int32 ``[D, 2]``: the (row, sequence) of every row at or past its ``decode_from``."""
        return decode_rows(self.query_start_loc, self.seq_lens, self.decode_from)

    def to_device(self, device: torch.device | str) -> DeviceBatch:
        """The same arrays as torch tensors on ``device``: shared memory on the CPU (no copies),
        ``non_blocking`` copies elsewhere; ``max_query_len``, ``decode_rows`` and ``logits_all_rows``
        worked out here, on the host, so kernels never synchronize to learn them."""
        import torch

        target = torch.device(device)
        tensors = {f.name: _to_tensor(getattr(self, f.name), target) for f in fields(self)}
        rows = _to_tensor(self.decode_rows(), target)
        every_row = np.array_equal(self.logits_indices, np.arange(self.num_tokens))
        return DeviceBatch(
            **tensors, decode_rows=rows, max_query_len=self.max_query_len, logits_all_rows=every_row
        )


@dataclass(frozen=True)
class DeviceBatch:
    """``StepBatch`` as torch tensors on one device (same names, same dtypes)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    decode_from: torch.Tensor
    decode_rows: torch.Tensor | None = None  # int32 [D, 2] (StepBatch.decode_rows); None: unknown
    max_query_len: int | None = None  # None: unknown (the kernels read it on the device)
    # logits_indices is 0..T-1 (every row's logits, in order, as in a decode step): the LM head reads
    # the rows as they are, with no gather
    logits_all_rows: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device


def default_decode_from(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """int32 ``[S]``, for plans that do not say: a lone new token after a context is a sampled one (a
    decode step), any other run of tokens is prompt."""
    q_lens = np.diff(query_start_loc)
    first = seq_lens - q_lens
    return np.where((q_lens == 1) & (first > 0), first, seq_lens).astype(np.int32)


def decode_rows(query_start_loc: np.ndarray, seq_lens: np.ndarray, decode_from: np.ndarray) -> np.ndarray:
    """int32 ``[D, 2]``, in row order: (row, sequence) of every row whose position is at or past its
    sequence's ``decode_from`` (the rows attention computes as decode rows)."""
    q_lens = np.diff(query_start_loc)
    seq_of_row = np.repeat(np.arange(q_lens.shape[0], dtype=np.int32), q_lens)
    rows = np.arange(query_start_loc[0], query_start_loc[-1], dtype=np.int32)
    positions = (seq_lens - q_lens)[seq_of_row] + rows - query_start_loc[:-1][seq_of_row]
    keep = positions >= decode_from[seq_of_row]
    return np.stack([rows[keep], seq_of_row[keep]], axis=1).astype(np.int32)


@dataclass(frozen=True)
class _SequencePlan:
    block_table: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seq_len: int
    logit_rows: np.ndarray
    decode_from: int | None  # None: the default (``default_decode_from``)


def _plan_sequence(
    index: int,
    block_table: Sequence[int],
    context_len: int,
    new_tokens: Sequence[int],
    want_logits: bool | LogitRows,
    decode_from: int | None = None,
) -> _SequencePlan:
    table = np.asarray(block_table, dtype=np.int64).reshape(-1)
    tokens = np.asarray(new_tokens, dtype=np.int64).reshape(-1)
    if context_len < 0 or tokens.size == 0:
        raise ValueError(f"sequence {index}: needs context_len >= 0 and at least one new token")
    seq_len = context_len + tokens.size
    if table.size * BLOCK_TOKENS < seq_len or (table.size and table.min() < 0):
        raise ValueError(
            f"sequence {index}: block table {table.tolist()} cannot hold {seq_len} tokens "
            f"({BLOCK_TOKENS} per block, ids >= 0)"
        )
    positions = np.arange(context_len, seq_len, dtype=np.int64)
    slots = table[positions // BLOCK_TOKENS] * BLOCK_TOKENS + positions % BLOCK_TOKENS
    rows = _logit_rows(index, tokens.size, want_logits)
    if decode_from is not None and decode_from < 0:
        raise ValueError(f"sequence {index}: decode_from must be >= 0, got {decode_from}")
    return _SequencePlan(table, tokens, positions, slots, seq_len, rows, decode_from)


def _logit_rows(index: int, n: int, want: bool | LogitRows) -> np.ndarray:
    mode = ("all" if want else "none") if isinstance(want, bool) else want
    if mode == "all":
        return np.arange(n, dtype=np.int64)
    if mode == "last":
        return np.array([n - 1], dtype=np.int64)
    if mode == "none":
        return np.zeros(0, dtype=np.int64)
    raise ValueError(f"sequence {index}: want_logits must be a bool or 'none'/'last'/'all', got {want!r}")


def _to_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    import torch

    array = np.ascontiguousarray(array)
    if array.flags.writeable:  # the core's plan arrays: the common, fast case
        tensor = torch.from_numpy(array)
    else:
        # A read-only view (a caller's); the model never writes into its plan. (catch_warnings resets
        # the warnings registry, so only this path pays for it.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.to(device, non_blocking=True)

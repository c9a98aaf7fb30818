"""``DeviceHistories``: each running request's token history as rows on the device, kept across steps,
for the penalties of device sampling (``sampling_batch.SamplingBatch``).

A request gets a slot the first step it samples with a repetition, frequency or presence penalty: its
``seen`` row (bool ``[V]``: in the prompt or the output) and ``counts`` row (float32 ``[V]``:
occurrences in the output) are built from its lists. On later steps only the tokens its output gained
since are added, all rows in one scatter, so a step costs host work in the new tokens, not in the
histories' lengths. A row whose lists no longer extend what it holds (a prompt of another length under
the same key, an output shorter than counted or whose last counted token changed) is rebuilt from the
lists. ``forget(key)`` frees the slot of a
finished request; slots grow by doubling and are reused.

Ids are checked against the vocabulary before anything is written: a ValueError leaves every row as
it was."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MIN_SLOTS = 8


@dataclass
class _Row:
    slot: int
    prompt_len: int
    counted: int  # output tokens already in the row
    last: int  # the last of them (-1: none), to notice an output rewritten under the same key


class DeviceHistories:
    """``seen`` and ``counts`` rows of ``vocab`` ids per request key, on ``device``."""

    def __init__(self, vocab: int, device: torch.device | str) -> None:
        self.vocab = vocab
        self.device = torch.device(device)
        self.seen = torch.zeros((0, vocab), dtype=torch.bool, device=self.device)
        self.counts = torch.zeros((0, vocab), dtype=torch.float32, device=self.device)
        self._rows: dict[int, _Row] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    def slots(
        self, keys: Sequence[int], prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """The slots (int64 ``[R]`` on the device) holding these requests' histories, brought up to date
        with their lists first."""
        fresh = {k for k, p, o in zip(keys, prompts, outputs, strict=True) if not self._extends(k, p, o)}
        adds = _Adds()
        for key, prompt, output in zip(keys, prompts, outputs, strict=True):
            row = self._rows.get(key)
            if key in fresh:
                adds.seen(prompt, key)
                adds.output(output, key)
            else:
                assert row is not None
                adds.output(output[row.counted :], key)
        adds.check(self.vocab)
        self._reserve(fresh)
        for key, prompt, output in zip(keys, prompts, outputs, strict=True):
            row = self._rows[key]
            row.prompt_len, row.counted = len(prompt), len(output)
            row.last = output[-1] if len(output) else -1
        self._write(adds, fresh)
        return self._index([self._rows[k].slot for k in keys])

    def forget(self, key: int) -> None:
        """Frees the slot of ``key`` (a finished request), if it has one."""
        row = self._rows.pop(key, None)
        if row is not None:
            self._free.append(row.slot)

    def _extends(self, key: int, prompt: Sequence[int], output: Sequence[int]) -> bool:
        """Whether the row of ``key`` holds a prefix of these lists (so only new tokens are missing)."""
        row = self._rows.get(key)
        if row is None or row.prompt_len != len(prompt) or row.counted > len(output):
            return False
        return row.counted == 0 or output[row.counted - 1] == row.last

    def _reserve(self, keys: set[int]) -> None:
        """A slot for every key in ``keys`` that has none, growing the tables when none is free."""
        new = [k for k in keys if k not in self._rows]
        missing = len(new) - len(self._free)
        if missing > 0:
            self._grow(self.seen.shape[0] + missing)
        for key in new:
            self._rows[key] = _Row(self._free.pop(), 0, 0, -1)

    def _grow(self, needed: int) -> None:
        capacity = self.seen.shape[0]
        grown = max(MIN_SLOTS, 2 * capacity, needed)
        seen = torch.zeros((grown, self.vocab), dtype=torch.bool, device=self.device)
        counts = torch.zeros((grown, self.vocab), dtype=torch.float32, device=self.device)
        seen[:capacity] = self.seen
        counts[:capacity] = self.counts
        self.seen, self.counts = seen, counts
        self._free.extend(range(grown - 1, capacity - 1, -1))  # lowest slot first

    def _write(self, adds: _Adds, fresh: set[int]) -> None:
        """Clears the rebuilt rows, then applies ``adds`` in one scatter per table."""
        if fresh:
            cleared = self._index(sorted(self._rows[k].slot for k in fresh))
            self.seen.index_fill_(0, cleared, False)
            self.counts.index_fill_(0, cleared, 0.0)
        slot_of = {key: row.slot for key, row in self._rows.items()}
        if adds.seen_ids:
            rows, ids = adds.pairs(adds.seen_keys, adds.seen_ids, slot_of, self.device)
            self.seen.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.bool))
        if adds.output_ids:
            rows, ids = adds.pairs(adds.output_keys, adds.output_ids, slot_of, self.device)
            self.seen.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.bool))
            self.counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)


class _Adds:
    """The ids to mark, per key: prompt ids (seen only) and output ids (seen and counted)."""

    def __init__(self) -> None:
        self.seen_keys: list[int] = []
        self.seen_ids: list[Sequence[int]] = []
        self.output_keys: list[int] = []
        self.output_ids: list[Sequence[int]] = []

    def seen(self, ids: Sequence[int], key: int) -> None:
        if len(ids):
            self.seen_keys.append(key)
            self.seen_ids.append(ids)

    def output(self, ids: Sequence[int], key: int) -> None:
        if len(ids):
            self.output_keys.append(key)
            self.output_ids.append(ids)

    def check(self, vocab: int) -> None:
        for ids in (*self.seen_ids, *self.output_ids):
            array = np.asarray(ids, dtype=np.int64)
            bad = np.flatnonzero((array < 0) | (array >= vocab))
            if bad.size:
                raise ValueError(f"token id {array[bad[0]]} is not a token id of a vocabulary of {vocab}")

    @staticmethod
    def pairs(
        keys: Sequence[int], ids: Sequence[Sequence[int]], slot_of: dict[int, int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot per id, id)`` as two int64 tensors on ``device``."""
        lengths = [len(i) for i in ids]
        slots = np.repeat(np.array([slot_of[k] for k in keys], dtype=np.int64), lengths)
        flat = np.concatenate([np.asarray(i, dtype=np.int64) for i in ids])
        both = torch.from_numpy(np.stack([slots, flat])).to(device, non_blocking=True)
        return both[0], both[1]

"""CUDA graphs for decode steps: ``DecodeGraphs`` runs a pure decode step (one new token per
sequence, every row's logits wanted) as one graph replay instead of a few hundred kernel launches.

A graph replays fixed tensors, so a step is padded into a **bucket**: the smallest of
``decode_buckets(max_num_seqs)`` (1, 2, 4, 8, then multiples of 8, and ``max_num_seqs``) that holds
its ``n`` sequences. The padding rules:

- a padding row is sequence ``i`` (``n <= i < bucket``) with one token: id 0 at position 0, KV slot
  -1 (``write_kv`` stores nothing for it), KV length 1 and a block table of zeros, so its attention
  reads block 0, offset 0 of the pool (finite: the pool is zero-initialized and only ever holds
  finished K/V) and it writes nothing;
- block tables are padded with zeros to ``blocks_for(max_model_len)`` columns; kernels read only the
  positions below each sequence's KV length;
- every row is its own sequence, so ``query_start_loc`` is ``0..bucket`` and ``logits_indices``
  ``0..bucket - 1``; the step's logits are the first ``n`` rows of the bucket's output;
- every row is a sampled token (``decode_from`` 0 for all, padding included): a step with a prompt row,
  such as a one-token prompt, is not a plain decode and runs eagerly.

Every op of the forward pass is row-wise or per sequence, so padding rows never change a real row,
and a bucket launches the Q1 kernel and tile height an eager step of ``n`` rows picks (the f16x2 GEMV
for 1-2 rows, the GEMV's power-of-two rows up to 8, ``q1_triton.gemm_block_m`` above: each changes
only at a bucket boundary): graph and eager steps give the same tokens.

All buckets' inputs are views of one int32 device buffer, filled by one host-to-device copy per step
from one (pinned) host buffer; the graphs are captured lazily, the first time a bucket is needed,
into one shared memory pool. Off CUDA (``capture=False``) the same padded buffers run the forward
pass eagerly: that is how CPU tests check the padding rules. A capture that fails turns graphs off
with a warning; the step then runs eagerly."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from oxibonsai.torch_backend.batch import DeviceBatch, StepBatch
from oxibonsai.torch_backend.kv_pool import KvPool
from oxibonsai.torch_backend.model import TorchQwen3

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8
WARMUP_RUNS = 2  # eager runs on a side stream before a capture: Triton compiles there, not in the graph


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, 16, 24, ... and ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {b for b in SMALL_BUCKETS if b <= max_num_seqs}
    sizes.update(range(2 * BUCKET_STEP, max_num_seqs + 1, BUCKET_STEP))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def is_plain_decode(batch: StepBatch) -> bool:
    """Whether ``batch`` is a step graphs can run: one token and one logits row per sequence, every
    token a sampled one (no prompt row)."""
    n = batch.num_seqs
    plain = n > 0 and batch.num_tokens == n and batch.logits_indices.shape[0] == n
    return plain and bool((batch.positions >= batch.decode_from).all())  # row i is sequence i's


class _Layout:
    """Where each input lives in the flat int32 buffer of ``max_batch`` rows and ``max_blocks`` table
    columns: slots first (int64, so 2 words each and 8-byte aligned), then the int32 fields."""

    def __init__(self, max_batch: int, max_blocks: int) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        b = max_batch
        self.slots = slice(0, 2 * b)
        self.input_ids = slice(2 * b, 3 * b)
        self.positions = slice(3 * b, 4 * b)
        self.seq_lens = slice(4 * b, 5 * b)
        self.query_start_loc = slice(5 * b, 6 * b + 1)
        self.logits_indices = slice(6 * b + 1, 7 * b + 1)
        self.decode_from = slice(7 * b + 1, 8 * b + 1)
        self.decode_rows = slice(8 * b + 1, 10 * b + 1)  # (i, i) for row i
        self.tables = slice(10 * b + 1, 10 * b + 1 + b * max_blocks)
        self.words = self.tables.stop

    def constants(self, buffer: np.ndarray) -> None:
        """Fields no step changes: one sequence per row, every row a sampled token."""
        buffer[self.query_start_loc] = np.arange(self.max_batch + 1, dtype=np.int32)
        buffer[self.logits_indices] = np.arange(self.max_batch, dtype=np.int32)
        buffer[self.decode_from] = 0
        buffer[self.decode_rows] = np.repeat(np.arange(self.max_batch, dtype=np.int32), 2)

    def fill(self, buffer: np.ndarray, batch: StepBatch, bucket: int) -> None:
        """The step's rows, then padding rows up to ``bucket`` (see the module doc)."""
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        buffer[self.slots].view(np.int64)[:bucket] = -1
        buffer[self.slots].view(np.int64)[:n] = batch.slot_mapping
        for name, values, pad in (
            ("input_ids", batch.input_ids, 0),
            ("positions", batch.positions, 0),
            ("seq_lens", batch.seq_lens, 1),
        ):
            field = buffer[getattr(self, name)]
            field[:n] = values
            field[n:bucket] = pad
        tables = buffer[self.tables].reshape(self.max_batch, self.max_blocks)
        tables[:bucket] = 0
        tables[:n, :width] = batch.block_tables

    def used_words(self, bucket: int) -> int:
        """The buffer's words a step of ``bucket`` rows reads: everything before the block tables, then
        the tables' first ``bucket`` rows (the rest can be stale: no view of the bucket reaches it)."""
        return self.tables.start + bucket * self.max_blocks

    def device_batch(self, words: torch.Tensor, bucket: int) -> DeviceBatch:
        """The bucket's inputs as views of the device buffer ``words``."""
        tables = words[self.tables].view(self.max_batch, self.max_blocks)
        return DeviceBatch(
            input_ids=words[self.input_ids][:bucket],
            positions=words[self.positions][:bucket],
            slot_mapping=words[self.slots].view(torch.int64)[:bucket],
            query_start_loc=words[self.query_start_loc][: bucket + 1],
            seq_lens=words[self.seq_lens][:bucket],
            block_tables=tables[:bucket],
            logits_indices=words[self.logits_indices][:bucket],
            decode_from=words[self.decode_from][:bucket],
            decode_rows=words[self.decode_rows].view(self.max_batch, 2)[:bucket],
            max_query_len=1,
            logits_all_rows=True,
        )


class DecodeGraphs:
    """Decode steps of up to ``max_num_seqs`` sequences of up to ``max_model_len`` tokens, run as CUDA
    graphs (``capture=True``, CUDA only) or as the same padded steps eagerly (``capture=False``)."""

    def __init__(
        self, model: TorchQwen3, kv: KvPool, *, max_num_seqs: int, max_model_len: int, capture: bool
    ) -> None:
        device = kv.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV pool is on {device}")
        self.model, self.kv, self.capture = model, kv, capture
        self.buckets = decode_buckets(max_num_seqs)
        self.layout = _Layout(self.buckets[-1], -(-max_model_len // kv.data.shape[3]))
        cuda = device.type == "cuda"
        self._host = torch.zeros(self.layout.words, dtype=torch.int32, pin_memory=cuda)
        self.layout.constants(self._host.numpy())
        self._words = self._host.to(device) if cuda else self._host
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self.enabled = True
        self.replays = 0

    def fits(self, batch: StepBatch) -> bool:
        """Whether this step can run here: a plain decode of at most ``max_num_seqs`` sequences whose
        block tables fit ``max_model_len``."""
        return (
            self.enabled
            and is_plain_decode(batch)
            and batch.num_seqs <= self.buckets[-1]
            and batch.block_tables.shape[1] <= self.layout.max_blocks
        )

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, batch: StepBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits ``[n, vocab]`` of a step that ``fits``; valid until the next ``run``. ``fed``:
        the step's token ids on the device (a step planned ahead), in place of the batch's."""
        n = batch.num_seqs
        bucket = self.bucket_for(n)
        self._load(batch, bucket)
        if fed is not None:  # behind the inputs' copy, on the same stream
            self._words[self.layout.input_ids][:n].copy_(fed)
        # A replay reads the buffer the graph was captured on: the bucket's views (~30 µs of host time
        # before the replay can start) are built only to capture or to run eagerly.
        if self.capture:
            graph = self._graphs.get(bucket)
            if graph is None:
                graph = self._capture(bucket, self.layout.device_batch(self._words, bucket))
            if graph is not None:
                graph[0].replay()
                self.replays += 1
                return graph[1][:n]
        return self.model.forward(self.layout.device_batch(self._words, bucket), self.kv)[:n]

    def _load(self, batch: StepBatch, bucket: int) -> None:
        """The step's inputs into the device buffer: one copy from the host buffer of the words the
        bucket reads (a whole buffer of 256 rows at a 32k context would be 2 MB every step: about 80 us
        at 25 GB/s, an estimate); the host buffer is rewritten only once the previous step's copy has
        finished."""
        if self._copied is not None:
            self._copied.synchronize()
        self.layout.fill(self._host.numpy(), batch, bucket)
        if self._words is not self._host:
            used = self.layout.used_words(bucket)
            self._words[:used].copy_(self._host[:used], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _capture(self, bucket: int, inputs: DeviceBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Captures the bucket's forward pass (its warm-up runs compute this step's K/V, which the
        replay then writes again, unchanged); on failure turns graphs off and returns None."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self.model.forward(inputs, self.kv)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.model.forward(inputs, self.kv)
        except RuntimeError as err:  # a kernel that cannot be captured: run eagerly from now on
            self.enabled = False
            warnings.warn(f"CUDA graph capture failed, decode runs eagerly: {err}", stacklevel=2)
            return None
        self._graphs[bucket] = (graph, logits)
        return self._graphs[bucket]

"""KV memory for the torch path: ``KvPool``, one tensor holding every layer's K and V blocks;
``copy_blocks``, which moves whole blocks between two pools; and ``TierCopier``, which runs each step's
tier copies on a side CUDA stream.

Two layouts (2 = K, V):

- **layer-major** ``[num_layers, 2, num_blocks, 16, kv_heads, head_dim]``, the device pool: ``layer(l)``
  gives the ``[num_blocks, 16, kv_heads, head_dim]`` views the attention kernels read and write, and a
  list of block moves is one gather and one scatter on dim 2, whatever the number of layers;
- **block-major** ``[num_blocks, num_layers, 2, 16, kv_heads, head_dim]``, the host tier: each block is
  one contiguous run of bytes, so a block moves between host and device as one DMA copy straight from
  (or into) the pinned pool, with no byte touched by the host's CPU (consecutive blocks as one copy).

This module owns the bytes and the copies only. It never decides which block holds what, which blocks
are free or which move where: the Rust core's pool and trie do, and hand over block ids and
``(source, destination)`` move lists."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from oxibonsai.torch_backend.batch import BLOCK_TOKENS


class KvPool:
    """K and V blocks of every layer in one tensor ``data`` (see the module doc for the layout)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin: bool = False,
        block_major: bool = False,
    ) -> None:
        dims = {
            "num_layers": num_layers,
            "num_blocks": num_blocks,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
        }
        for name, value in dims.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KvPool: {name} must be a positive int, got {value!r}")
        self.block_major = block_major
        per_block = (BLOCK_TOKENS, kv_heads, head_dim)
        shape = (
            (num_blocks, num_layers, 2, *per_block)
            if block_major
            else (num_layers, 2, num_blocks, *per_block)
        )
        # Zeros, not empty: attention may read a whole block past a sequence's end (masked out), and
        # masked garbage that happens to be NaN would still poison `probs @ v`.
        self.pinned = pin and torch.device(device).type == "cpu" and torch.cuda.is_available()
        if self.pinned:
            self.data = _pinned_zeros(shape, dtype)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return num_layers * 2 * BLOCK_TOKENS * kv_heads * head_dim * itemsize

    @property
    def num_layers(self) -> int:
        return int(self.data.shape[1 if self.block_major else 0])

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[self.block_dim])

    @property
    def block_dim(self) -> int:
        """The dimension of ``data`` that indexes blocks."""
        return 0 if self.block_major else 2

    @property
    def kv_heads(self) -> int:
        return int(self.data.shape[4])

    @property
    def head_dim(self) -> int:
        return int(self.data.shape[5])

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_block(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s ``(k_cache, v_cache)``: views ``[num_blocks, 16, kv_heads, head_dim]``."""
        if self.block_major:
            raise ValueError("a block-major pool (a host tier) has no layer views")
        if not 0 <= index < self.num_layers:
            raise IndexError(f"KvPool has {self.num_layers} layers, asked for layer {index}")
        return self.data[index, 0], self.data[index, 1]

    def blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """Copies of blocks ``ids`` in the layer-major order ``[num_layers, 2, len(ids), 16, kv_heads,
        head_dim]``, whatever this pool's layout (``ids`` on the pool's device)."""
        picked = self.data.index_select(self.block_dim, ids)
        return picked.permute(1, 2, 0, 3, 4, 5) if self.block_major else picked

    def __repr__(self) -> str:
        return (
            f"KvPool(layers={self.num_layers}, blocks={self.num_blocks}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, pinned={self.pinned}, "
            f"block_major={self.block_major})"
        )


def copy_blocks(src: KvPool, dst: KvPool, pairs: np.ndarray) -> None:
    """Copies block ``pairs[i, 0]`` of ``src`` onto block ``pairs[i, 1]`` of ``dst``, every layer, K and
    V, in stream order on the current stream: a gather on the source, at most one transfer per run of
    consecutive blocks of a block-major pool (one transfer otherwise), a scatter on the destination.
    Copies to or from a pinned pool are asynchronous: read a host pool only after synchronizing.
    Everything is checked first: on a ValueError nothing has been copied."""
    _move(src, dst, *_check_moves(src, dst, pairs))


def _move(src: KvPool, dst: KvPool, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """``copy_blocks`` of checked id lists."""
    if src_ids.size:
        _scatter(dst, dst_ids, _gather(src, src_ids, dst))


class TierCopier:
    """Runs each step's tier copies between the device pool and the host tier (``TierCopies`` in the
    Rust core): demotions (device -> host) and promotions (host -> device), which the step's forward
    pass waits for, and prefetches (host -> device, for requests still waiting), which only the next
    step waits for.

    On CUDA they run on a side stream that first waits for the work already queued (the KV that
    demotions read). There the demotions' blocks are gathered into one contiguous device buffer, the
    promotions are copied in and scattered, and only then is the event the forward pass waits for
    recorded: the demotions' device-to-host transfers and the prefetches run after it, beside the
    forward pass, and the next step's forward pass waits for them (its own copies queue behind them on
    the same stream, and a step without copies waits for the prefetch event). So every read of a host
    block follows its write, including a promotion or prefetch of a block demoted in the same step
    (its transfer is then moved ahead of the promotions). Elsewhere the copies run in order on the
    current stream."""

    def __init__(self, device_pool: KvPool, host_pool: KvPool) -> None:
        self.kv, self.host = device_pool, host_pool
        cuda = device_pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(device_pool.device) if cuda else None
        self._prefetched: torch.cuda.Event | None = None  # the last step's prefetches, on CUDA

    def run(self, demote: np.ndarray, promote: np.ndarray, prefetch: np.ndarray | None = None) -> None:
        """Queues one step's copies before its forward pass; every list is checked first, so a
        ValueError copies nothing."""
        if prefetch is None:
            prefetch = _NO_MOVES
        if not (len(demote) or len(promote) or len(prefetch)):
            self._await_prefetches()
            return
        from_ids, to_ids = _check_moves(self.kv, self.host, demote)
        promoted = _check_moves(self.host, self.kv, promote)
        prefetched = _check_moves(self.host, self.kv, prefetch)
        if self.stream is None:
            _move(self.kv, self.host, from_ids, to_ids)
            _move(self.host, self.kv, *promoted)
            _move(self.host, self.kv, *prefetched)
            return
        compute = torch.cuda.current_stream(self.kv.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            demoted = _gather(self.kv, from_ids, self.host) if from_ids.size else None
            if demoted is not None and np.isin(promoted[0], to_ids).any():
                _scatter(self.host, to_ids, demoted)  # a promotion reads a block demoted just now
                demoted = None
            _move(self.host, self.kv, *promoted)
            ready = torch.cuda.Event()
            ready.record(self.stream)
            if demoted is not None:
                _scatter(self.host, to_ids, demoted)
            _move(self.host, self.kv, *prefetched)
            self._prefetched = None
            if prefetched[0].size:
                self._prefetched = torch.cuda.Event()
                self._prefetched.record(self.stream)
        compute.wait_event(ready)  # queued after the last step's prefetches: covers them too

    def _await_prefetches(self) -> None:
        """A step without copies: its forward pass still waits for the last step's prefetches."""
        if self._prefetched is not None:
            torch.cuda.current_stream(self.kv.device).wait_event(self._prefetched)
            self._prefetched = None

    def synchronize(self) -> None:
        """Waits for every queued copy (before the host reads or frees the host tier)."""
        if self.stream is not None:
            self.stream.synchronize()


_NO_MOVES = np.zeros((0, 2), dtype=np.int32)


def _gather(src: KvPool, ids: np.ndarray, dst: KvPool) -> torch.Tensor:
    """Blocks ``ids`` of ``src`` in ``dst``'s layout with the blocks in order: on ``dst``'s device,
    except on the way into a block-major pool on another device, where it stays contiguous on the
    source's device for ``_scatter`` to copy run by run."""
    if src.block_major and src.device != dst.device:  # the host tier to the device: a DMA per run
        staging = torch.empty((ids.size, *src.data.shape[1:]), dtype=src.dtype, device=dst.device)
        for first, count, at in _runs(ids):
            staging[at : at + count].copy_(src.data[first : first + count], non_blocking=src.pinned)
        return staging if dst.block_major else _relayout(staging, to_block_major=False)
    moved = src.data.index_select(src.block_dim, _index(ids, src.device))
    if src.block_major != dst.block_major:
        moved = _relayout(moved, to_block_major=dst.block_major)
    if moved.device == dst.device:
        return moved
    if dst.block_major:
        return moved.contiguous()
    # Host-bound copies block (the host may read them at once); device-bound ones need not.
    return moved.to(dst.device, non_blocking=dst.device.type != "cpu")


def _scatter(dst: KvPool, ids: np.ndarray, moved: torch.Tensor) -> None:
    """Writes ``moved`` (``dst``'s layout, blocks in the order of ``ids``) into blocks ``ids``."""
    if moved.device == dst.device:
        dst.data.index_copy_(dst.block_dim, _index(ids, dst.device), moved)
        return
    for first, count, at in _runs(ids):  # a device-made block-major copy into the host pool
        dst.data[first : first + count].copy_(moved[at : at + count], non_blocking=dst.pinned)


def _relayout(blocks: torch.Tensor, *, to_block_major: bool) -> torch.Tensor:
    """A view of ``blocks`` in the other layout (a permutation of the first three dimensions)."""
    return blocks.permute(2, 0, 1, 3, 4, 5) if to_block_major else blocks.permute(1, 2, 0, 3, 4, 5)


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(first id, count, position)`` of each run of consecutive ids (``ids[i + 1] == ids[i] + 1``)."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [ids.size]]))
    return [(int(ids[a]), int(c), int(a)) for a, c in zip(starts, counts, strict=True)]


def _index(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    index = torch.from_numpy(ids)
    return index if device.type == "cpu" else index.to(device, non_blocking=True)


def _check_moves(src: KvPool, dst: KvPool, pairs: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(source ids, destination ids)`` as int64, after checking shapes, ranges and duplicates."""
    _check_compatible(src, dst)
    moves = np.asarray(pairs)
    if moves.ndim != 2 or moves.shape[1] != 2 or (moves.size and moves.dtype.kind not in "iu"):
        raise ValueError(
            f"block pairs must be an integer array of shape (n, 2), got {moves.dtype} {moves.shape}"
        )
    src_ids = np.ascontiguousarray(moves[:, 0], dtype=np.int64)
    dst_ids = np.ascontiguousarray(moves[:, 1], dtype=np.int64)
    _check_range("source", src_ids, src.num_blocks)
    _check_range("destination", dst_ids, dst.num_blocks)
    unique, counts = np.unique(dst_ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"destination blocks {unique[counts > 1].tolist()} appear more than once")
    return src_ids, dst_ids


def _check_range(what: str, ids: np.ndarray, num_blocks: int) -> None:
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.size:
        raise ValueError(f"{what} block ids {bad[:8].tolist()} are outside 0..{num_blocks - 1}")


def _check_compatible(src: KvPool, dst: KvPool) -> None:
    def layout(p: KvPool) -> tuple[object, ...]:  # the block's contents, not the pool's layout
        return (p.num_layers, p.kv_heads, p.head_dim, p.dtype)

    if layout(src) != layout(dst):
        raise ValueError(
            f"pools differ in (layers, kv_heads, head_dim, dtype): {layout(src)} vs {layout(dst)}"
        )


PAGE_BYTES = 4096  # cudaHostRegister locks whole pages


def _pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in page-locked host memory. ``cudaHostRegister`` as vLLM does (torch's pinned allocator
    would round the size up to a power of two) on a buffer whose pages hold nothing else: the driver
    locks whole pages, and a small tensor from the heap shares its first and last pages with its
    neighbours, so registering it after a registered neighbour fails (the range is already mapped).
    Falls back to ``pin_memory()`` (a copy) when registering fails."""
    data, ptr, span = page_aligned_zeros(shape, dtype)
    status = torch.cuda.cudart().cudaHostRegister(ptr, span, 0)  # type: ignore[no-untyped-call]
    if int(status) == 0:
        # Unregister before the pages go back to the allocator: a later registration of a reused
        # address range would fail.
        weakref.finalize(data, _host_unregister, ptr)
        return data
    _clear_cuda_error()
    return data.pin_memory()


def page_aligned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """A contiguous zero tensor that starts a page and owns whole pages (a view into a buffer a page
    larger), its first byte's address and the bytes of those pages."""
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    span = -(-max(nbytes, 1) // PAGE_BYTES) * PAGE_BYTES
    buffer = torch.zeros(span + PAGE_BYTES, dtype=torch.uint8)
    offset = -buffer.data_ptr() % PAGE_BYTES
    data = buffer[offset : offset + nbytes].view(dtype).view(shape)
    return data, data.data_ptr(), span


def _clear_cuda_error() -> None:
    """Takes a failed runtime call's error off the thread, where torch's next kernel launch check would
    report it as its own: torch binds no ``cudaGetLastError``, so a trivial launch reads it."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


def _host_unregister(ptr: int) -> None:
    torch.cuda.synchronize()  # a side stream's transfer may still be writing the pages
    torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]

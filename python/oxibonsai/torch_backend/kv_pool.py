"""KV memory for the torch path: ``KvPool``, one tensor holding every layer's K and V blocks, and
``copy_blocks``, which moves whole blocks between two pools (device <-> pinned host, or within one).

The layout is ``[num_layers, 2, num_blocks, 16, kv_heads, head_dim]`` (2 = K, V): a block is one index
on dim 2 for all layers at once, so a list of block moves is one gather and one scatter, whatever the
number of layers. ``layer(l)`` gives the ``[num_blocks, 16, kv_heads, head_dim]`` views the attention
kernels read and write.

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
        shape = (num_layers, 2, num_blocks, BLOCK_TOKENS, kv_heads, head_dim)
        # Zeros, not empty: attention may read a whole block past a sequence's end (masked out), and
        # masked garbage that happens to be NaN would still poison `probs @ v`.
        data = torch.zeros(shape, dtype=dtype, device=device)
        self.pinned = False
        if pin and data.device.type == "cpu":
            data, self.pinned = _pin_host(data)
        self.data = data

    @staticmethod
    def bytes_per_block(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return num_layers * 2 * BLOCK_TOKENS * kv_heads * head_dim * itemsize

    @property
    def num_layers(self) -> int:
        return int(self.data.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])

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
        if not 0 <= index < self.num_layers:
            raise IndexError(f"KvPool has {self.num_layers} layers, asked for layer {index}")
        return self.data[index, 0], self.data[index, 1]

    def __repr__(self) -> str:
        return (
            f"KvPool(layers={self.num_layers}, blocks={self.num_blocks}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, pinned={self.pinned})"
        )


def copy_blocks(src: KvPool, dst: KvPool, pairs: np.ndarray) -> None:
    """Copies block ``pairs[i, 0]`` of ``src`` onto block ``pairs[i, 1]`` of ``dst``, every layer, K and
    V: one gather on ``src``, at most one transfer, one scatter on ``dst``. Host -> device copies are
    asynchronous from a pinned pool; device -> host copies finish before returning (the host-side
    scatter reads them). Everything is checked first: on a ValueError nothing has been copied."""
    src_ids, dst_ids = _check_moves(src, dst, pairs)
    if src_ids.size == 0:
        return
    gathered = _gather(src, src_ids, staged=src.pinned and dst.device.type != "cpu")
    if gathered.device != dst.device:
        gathered = gathered.to(dst.device, non_blocking=src.pinned)
    dst.data.index_copy_(2, _index(dst_ids, dst.device), gathered)


def _gather(pool: KvPool, ids: np.ndarray, *, staged: bool) -> torch.Tensor:
    """``pool.data[:, :, ids]``; into a pinned buffer when it is headed for a device."""
    index = _index(ids, pool.device)
    if not staged:
        return pool.data.index_select(2, index)
    shape = (*pool.data.shape[:2], ids.size, *pool.data.shape[3:])
    staging = torch.empty(shape, dtype=pool.dtype, pin_memory=True)
    return torch.index_select(pool.data, 2, index, out=staging)


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
    def layout(p: KvPool) -> tuple[object, ...]:
        return (p.num_layers, p.kv_heads, p.head_dim, p.dtype)

    if layout(src) != layout(dst):
        raise ValueError(
            f"pools differ in (layers, kv_heads, head_dim, dtype): {layout(src)} vs {layout(dst)}"
        )


def _pin_host(data: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Page-locks a host tensor where CUDA exists (no-op otherwise). ``cudaHostRegister`` on the tensor
    as vLLM does: torch's pinned allocator would round the size up to a power of two. Falls back to
    ``pin_memory()`` (a copy) when registering fails."""
    if not torch.cuda.is_available():
        return data, False
    nbytes = data.numel() * data.element_size()
    status = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), nbytes, 0)  # type: ignore[no-untyped-call]
    if int(status) == 0:
        # Unregister before the pages go back to the allocator: a later registration of a reused
        # address range would fail.
        weakref.finalize(data, _host_unregister, data.data_ptr())
        return data, True
    return data.pin_memory(), True


def _host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]

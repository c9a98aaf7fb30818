"""The Q1 linear for MPS: Q1_0 weights repacked once into torch's groupwise int4 format and multiplied
by torch's built-in ``_weight_int4pack_mm``.

Why it exists: Triton does not target Metal, so MPS has no Q1 kernel of ours, and the reference op
(``ref_torch.q1_linear``) writes and reads a float32 copy of the whole matrix on every call. Torch ships
an int4 matmul with an MPS kernel, and Q1_0 maps onto it exactly: weight ``+-d`` is the 4-bit value
``q = 8 +- 1`` (9 for a set sign bit, 7 otherwise) in groups of 128 along K with scale ``d`` and zero 0,
which the op dequantizes as ``(q - 8) * scale + zero``. Activations stay float32 and the scales are
float32 copies of the fp16 ``d``, so every dequantized weight is exact and only the summation order
differs from the reference. On the CPU the same packing feeds the CPU twin of the op
(``_convert_weight_to_int4pack_for_cpu`` / ``_weight_int4pack_mm_for_cpu``), which is how CI tests it.

Cost: 4 bits per weight plus a float32 (scale, zero) pair per 128 weights, 4.5 bits in all: four times
the 1.125 bits of the Q1_0 form, which the model keeps as well (the embedding reads it). The packed form
is built on first use, a bounded slice of rows at a time (never a dense float matrix), and cached per
``Q1Weight`` object until that object is collected.

Requirements of the ops (torch 2.15): group size 128 divides K (true of every Q1_0 matrix) and K is a
multiple of 32 (``innerKTiles`` 2 times 16); N a multiple of 16 on the CPU, 8 on MPS. Any N is accepted
here: the packed matrix gets zero rows (scale 0) up to a multiple of 16 and the output drops them. Only
the CPU and MPS are supported; CUDA's version of the op takes bfloat16 activations only, which would not
be exact, and CUDA has the Triton kernels."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from oxibonsai.torch_backend.ops import ref_torch
from oxibonsai.torch_backend.ops.q1_weight import QK, WORD_BITS, Q1Weight

ROW_MULTIPLE = 16  # the CPU twin wants N % 16 == 0 (MPS: 8); rows are padded up to it
CHUNK_ROWS = 64  # the CPU packing works in 64-row blocks: converting such slices one by one is exact
PACK_CHUNK_WEIGHTS = 4 * 1024 * 1024  # weights per slice at pack time: 16 MiB of int32 temporaries
INNER_K_TILES = 2  # the packing's K tiling (2, 4 or 8); 2 asks the least of K (a multiple of 32)
SUPPORTED_DEVICES = ("cpu", "mps")

_CPU_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
_DEVICE_OPS = ("_convert_weight_to_int4pack", "_weight_int4pack_mm")


@dataclass(frozen=True)
class Int4Packed:
    """A ``rows x cols`` Q1_0 matrix in the layout of torch's int4-pack matmul on ``device``.

    ``packed`` is opaque (uint8 ``[padded_rows, cols // 2]`` on the CPU, int32
    ``[padded_rows // 8, cols // 32, 32, 1]`` on MPS); ``scales_and_zeros`` is float32
    ``[cols // 128, padded_rows, 2]`` holding ``(d, 0)`` per group, ``(0, 0)`` for padding rows."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    rows: int
    cols: int

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def padded_rows(self) -> int:
        return int(self.scales_and_zeros.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros))


_CACHE: dict[int, Int4Packed] = {}  # id(Q1Weight) -> its packed form; see packed_for


def ops_available(device_type: str) -> bool:
    """Whether the installed torch has the int4-pack ops that ``device_type`` needs."""
    names = _CPU_OPS if device_type == "cpu" else _DEVICE_OPS
    return device_type in SUPPORTED_DEVICES and all(hasattr(torch.ops.aten, n) for n in names)


def pack(w: Q1Weight, chunk_weights: int = PACK_CHUNK_WEIGHTS) -> Int4Packed:
    """Repacks ``w`` on its device, converting at most about ``chunk_weights`` weights at a time."""
    device = w.signs.device
    if not ops_available(device.type):
        raise ValueError(
            f"the int4-pack Q1 linear runs on {' or '.join(SUPPORTED_DEVICES)} with torch's "
            f"_weight_int4pack_mm ops; this torch has none for {device.type!r} (torch {torch.__version__})"
        )
    padded = -(-w.rows // ROW_MULTIPLE) * ROW_MULTIPLE
    step = max(CHUNK_ROWS, chunk_weights // w.cols // CHUNK_ROWS * CHUNK_ROWS)
    packed: torch.Tensor | None = None
    for start in range(0, padded, step):
        stop = min(start + step, padded)
        part = _convert(_nibbles(w, start, stop))
        if packed is None:  # one output, filled slice by slice: no list of parts, no concatenation
            rows_per_entry = (stop - start) // part.shape[0]  # of the leading dim: 1 (CPU) or 8 (MPS)
            packed = part.new_empty((padded // rows_per_entry, *part.shape[1:]))
        packed[start // rows_per_entry : stop // rows_per_entry] = part
    assert packed is not None
    scales_and_zeros = torch.zeros(w.cols // QK, padded, 2, dtype=torch.float32, device=device)
    scales_and_zeros[:, : w.rows, 0] = w.scales.T.to(torch.float32)
    return Int4Packed(packed=packed, scales_and_zeros=scales_and_zeros, rows=w.rows, cols=w.cols)


def q1_linear(x: torch.Tensor, w: Q1Weight) -> torch.Tensor:
    """``x [M, K] @ W.T`` -> float32 ``[M, N]`` (the ``ref_torch.q1_linear`` contract), packing ``w`` on
    its first use."""
    if x.shape[-1] != w.cols:
        raise ValueError(f"x has {x.shape[-1]} columns, the {w.rows}x{w.cols} Q1 matrix needs {w.cols}")
    p = packed_for(w)
    rows = x.reshape(-1, w.cols).to(torch.float32).contiguous()
    out = _mm(rows, p) if rows.shape[0] else rows.new_empty((0, p.padded_rows))
    if p.padded_rows != p.rows:
        out = out[:, : p.rows].contiguous()
    return out.reshape(*x.shape[:-1], p.rows)


def packed_for(w: Q1Weight) -> Int4Packed:
    """``w``'s packed form, built once and cached until ``w`` is collected.

    The cache is keyed by object identity: a ``WeakKeyDictionary`` would compare keys with the
    dataclass ``__eq__``, which compares tensors elementwise."""
    cached = _CACHE.get(id(w))
    if cached is None:
        cached = _CACHE[id(w)] = pack(w)
        weakref.finalize(w, _CACHE.pop, id(w), None)
    return cached


def ops_int4pack() -> SimpleNamespace:
    """The full op set with this module's ``q1_linear`` and the reference ops for everything else."""
    from oxibonsai.torch_backend.ops.dispatch import OP_NAMES  # here: dispatch imports this module

    ops = SimpleNamespace(**{name: getattr(ref_torch, name) for name in OP_NAMES})
    ops.q1_linear = q1_linear
    ops.q1_fused_linear = functools.partial(ref_torch.fused_linear, q1_linear)
    ops.attention_linear = functools.partial(
        ref_torch.composed_attention_linear, ref_torch.paged_attention, ops.q1_fused_linear
    )
    return ops


def _nibbles(w: Q1Weight, start: int, stop: int) -> torch.Tensor:
    """int32 ``[stop - start, cols]`` of 4-bit values for padded rows ``start:stop``: 9 where the sign
    bit is set, 7 where not, 8 (weight 0 under scale 0) past the last real row."""
    shifts = torch.arange(WORD_BITS, device=w.signs.device, dtype=torch.int32)
    real = w.signs[start : min(stop, w.rows)]
    bits = (real.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 still lands in bit 0
    q = bits.reshape(real.shape[0], w.cols) * 2 + 7
    pad = stop - max(start, w.rows)
    if pad > 0:
        q = torch.cat([q, q.new_full((pad, w.cols), 8)])
    return q


def _convert(q: torch.Tensor) -> torch.Tensor:
    """The op's packing of nibbles ``q``: the CPU twin takes them as int32, the device op as uint8 with
    two per byte, the even column in the high half."""
    if q.device.type == "cpu":
        packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    else:
        pairs = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)
    return packed


def _mm(x: torch.Tensor, p: Int4Packed) -> torch.Tensor:
    """float32 ``x [M, K]`` times the packed matrix: float32 ``[M, padded_rows]``."""
    if x.device != p.device:
        raise ValueError(f"x is on {x.device}, the packed Q1 matrix on {p.device}")
    op = (
        torch.ops.aten._weight_int4pack_mm_for_cpu
        if x.device.type == "cpu"
        else torch.ops.aten._weight_int4pack_mm
    )
    out: torch.Tensor = op(x, p.packed, QK, p.scales_and_zeros)
    return out

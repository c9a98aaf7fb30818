"""A Qwen3 GGUF file as torch tensors: ``Qwen3Config`` (the ``qwen3.*`` hyper-parameters) and
``Qwen3Weights`` (every tensor, bound by name and checked for presence, type and shape).

Mirrors the Rust loader (``rust/core/src/model/config.rs`` and ``weights.rs``) key for key and name for
name, with the same defaults and the same checks, so that both runners accept exactly the same files.
Q1_0 matrices become packed ``Q1Weight``s (sign words + fp16 scales: never dense outside tests); F32,
F16 and BF16 matrices become ``DenseWeight``s (float32); norm vectors float32 tensors. This is the only
place tensor names and metadata keys appear on the torch side; the forward pass never validates
anything, and this module never computes a forward pass."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from os import PathLike
from typing import Any

import numpy as np
import torch

from oxibonsai import GGUFError, GGUFFile
from oxibonsai._core import gguf_rope_scaling
from oxibonsai.rope_scaling import RopeScaling
from oxibonsai.torch_backend.dense import DenseWeight, Linear
from oxibonsai.torch_backend.fused import fuse_rows, row_views
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight

ARCH = "qwen3"
MAX_DIM = 1 << 24  # any single dimension beyond this is a corrupt file, not a model


@dataclass(frozen=True)
class Qwen3Config:
    """The shape and constants of a Qwen3 model (the Rust ``Qwen3Config``'s fields and names)."""

    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int  # rows of token_embd.weight
    context_length: int
    rope_base: float
    rms_eps: float
    rope_scaling: RopeScaling | None = None  # resolved (``RopeScaling.resolved``); None: plain RoPE

    @classmethod
    def from_gguf(cls, file: GGUFFile) -> Qwen3Config:
        """Reads and checks the config of a ``general.architecture = qwen3`` file."""
        return cls.from_metadata(file.metadata, _vocab_rows(file), RopeScaling.parse(gguf_rope_scaling(file)))

    @classmethod
    def from_metadata(
        cls, meta: Mapping[str, Any], vocab: int, rope_scaling: RopeScaling | None = None
    ) -> Qwen3Config:
        """The config from the keys of ``meta``; ``rope_scaling`` is the file's, as the native loader
        reads it (``_core.gguf_rope_scaling``: its keys appear in Rust only)."""
        arch = _get(meta, "general.architecture", str, required=True)
        if arch != ARCH:
            raise GGUFError(
                f"unsupported architecture {arch!r} (general.architecture); oxibonsai runs 'qwen3' models"
            )
        n_heads = _get_int(meta, "attention.head_count", required=True)
        hidden = _get_int(meta, "embedding_length", required=True)
        head_dim = _get_int(meta, "attention.key_length", hidden // n_heads if n_heads else 0)
        value_length = _get_int(meta, "attention.value_length", head_dim)
        if value_length != head_dim:
            raise GGUFError(
                f"{ARCH}.attention.value_length ({value_length}) differs from the key length ({head_dim}); "
                "not supported"
            )
        config = cls(
            n_layers=_get_int(meta, "block_count", required=True),
            hidden=hidden,
            ffn=_get_int(meta, "feed_forward_length", required=True),
            n_heads=n_heads,
            n_kv_heads=_get_int(meta, "attention.head_count_kv", n_heads),
            head_dim=head_dim,
            vocab=vocab,
            context_length=_get_int(meta, "context_length", required=True),
            rope_base=_get_float(meta, "rope.freq_base", 10_000.0),
            # The Rust config holds it as f32: round the same way.
            rms_eps=float(np.float32(_get_float(meta, "attention.layer_norm_rms_epsilon", 1e-6))),
            rope_scaling=rope_scaling,
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Checks that the numbers describe a model this engine can run (the Rust rules)."""
        positive = {
            "block_count": self.n_layers,
            "embedding_length": self.hidden,
            "feed_forward_length": self.ffn,
            "attention.head_count": self.n_heads,
            "attention.head_count_kv": self.n_kv_heads,
            "attention.key_length": self.head_dim,
            "context_length": self.context_length,
        }
        for name, value in positive.items():
            if not 0 < value <= MAX_DIM:
                raise GGUFError(f"{ARCH}.{name} must be in 1..={MAX_DIM}, got {value}")
        if self.n_heads % self.n_kv_heads:
            raise GGUFError(
                f"{ARCH}.attention.head_count ({self.n_heads}) must be a multiple of "
                f"head_count_kv ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise GGUFError(f"{ARCH}.attention.key_length must be even, got {self.head_dim}")
        if not (math.isfinite(self.rope_base) and self.rope_base > 1.0):
            raise GGUFError(f"{ARCH}.rope.freq_base must be finite and > 1, got {self.rope_base}")
        if not (math.isfinite(self.rms_eps) and self.rms_eps > 0.0):
            raise GGUFError(
                f"{ARCH}.attention.layer_norm_rms_epsilon must be finite and > 0, got {self.rms_eps}"
            )

    def with_rope(self, scaling: RopeScaling | None, theta: float | None) -> Qwen3Config:
        """This config with the caller's rope scaling (``"default"``: none) and base, where given."""
        config = self if theta is None else replace(self, rope_base=theta)
        if scaling is None:
            return config
        plain = scaling.rope_type == "default"
        return replace(config, rope_scaling=None if plain else scaling.resolved(self.context_length))

    @property
    def max_positions(self) -> int:
        """The longest sequence: the context length, stretched by the rope scaling if any."""
        scaling = self.rope_scaling
        return self.context_length if scaling is None else scaling.max_positions(self.context_length)

    @property
    def q_dim(self) -> int:
        """Width of all query heads together."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together."""
        return self.n_kv_heads * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block (the Rust ``LayerWeights``' fields). Where Q, K, V (gate, up) are of one
    kind, ``wqkv`` (``w_gate_up``) stacks them by rows and ``wq``... are row views of it (``fused``)."""

    attn_norm: torch.Tensor
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate: Linear
    w_up: Linear
    w_down: Linear
    wqkv: Linear | None = None
    w_gate_up: Linear | None = None

    def matrices(self) -> list[Linear]:
        """Every matrix once: the fused ones instead of their views."""
        qkv = [self.wqkv] if self.wqkv is not None else [self.wq, self.wk, self.wv]
        gate_up = [self.w_gate_up] if self.w_gate_up is not None else [self.w_gate, self.w_up]
        return [*qkv, self.wo, *gate_up, self.w_down]


@dataclass(frozen=True)
class Qwen3Weights:
    """All weights of a Qwen3 model; ``output`` is None when the LM head is tied to ``token_embd``."""

    token_embd: Linear
    layers: tuple[LayerWeights, ...]
    output_norm: torch.Tensor
    output: Linear | None

    @property
    def lm_head(self) -> Linear:
        return self.output if self.output is not None else self.token_embd

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (a tied head counted once)."""
        tensors: list[Any] = [self.token_embd, self.output_norm, self.output]
        for layer in self.layers:
            tensors += [layer.attn_norm, layer.q_norm, layer.k_norm, layer.ffn_norm, *layer.matrices()]
        return sum(_nbytes(t) for t in tensors if t is not None)

    @classmethod
    def from_gguf(cls, file: GGUFFile, config: Qwen3Config, device: torch.device | str) -> Qwen3Weights:
        """Binds every tensor of ``file`` on ``device``, checking it against ``config``."""
        reader = _TensorReader(file, torch.device(device))
        c = config
        token_embd = reader.matrix("token_embd.weight", c.vocab, c.hidden)
        layers = tuple(_load_layer(reader, c, i) for i in range(c.n_layers))
        output = reader.matrix("output.weight", c.vocab, c.hidden) if reader.has("output.weight") else None
        return cls(token_embd, layers, reader.vector("output_norm.weight", c.hidden), output)


def load_qwen3(
    source: str | PathLike[str] | GGUFFile,
    device: torch.device | str,
    *,
    rope_scaling: RopeScaling | None = None,
    rope_theta: float | None = None,
) -> tuple[Qwen3Config, Qwen3Weights]:
    """The config and weights of a Qwen3 GGUF file (a path or an open ``GGUFFile``) on ``device``;
    ``rope_scaling`` and ``rope_theta`` replace the file's."""
    file = source if isinstance(source, GGUFFile) else GGUFFile(source)
    config = Qwen3Config.from_gguf(file).with_rope(rope_scaling, rope_theta)
    return config, Qwen3Weights.from_gguf(file, config, device)


def _load_layer(reader: _TensorReader, c: Qwen3Config, i: int) -> LayerWeights:
    def m(t: str, rows: int, cols: int) -> Linear:
        return reader.matrix(f"blk.{i}.{t}.weight", rows, cols)

    def v(t: str, length: int) -> torch.Tensor:
        return reader.vector(f"blk.{i}.{t}.weight", length)

    layer = LayerWeights(
        attn_norm=v("attn_norm", c.hidden),
        wq=m("attn_q", c.q_dim, c.hidden),
        wk=m("attn_k", c.kv_dim, c.hidden),
        wv=m("attn_v", c.kv_dim, c.hidden),
        wo=m("attn_output", c.hidden, c.q_dim),
        q_norm=v("attn_q_norm", c.head_dim),
        k_norm=v("attn_k_norm", c.head_dim),
        ffn_norm=v("ffn_norm", c.hidden),
        w_gate=m("ffn_gate", c.ffn, c.hidden),
        w_up=m("ffn_up", c.ffn, c.hidden),
        w_down=m("ffn_down", c.hidden, c.ffn),
    )
    return fused_layer(layer)


def fused_layer(layer: LayerWeights) -> LayerWeights:
    """``layer`` with Q, K, V and gate, up stacked into ``wqkv`` and ``w_gate_up`` where they are of one
    kind, the separate matrices becoming row views of the stacked ones."""
    qkv, gate_up = [layer.wq, layer.wk, layer.wv], [layer.w_gate, layer.w_up]
    wqkv, w_gate_up = fuse_rows(qkv), fuse_rows(gate_up)
    if wqkv is not None:
        qkv = row_views(wqkv, [w.rows for w in qkv])
    if w_gate_up is not None:
        gate_up = row_views(w_gate_up, [w.rows for w in gate_up])
    return replace(
        layer,
        wq=qkv[0],
        wk=qkv[1],
        wv=qkv[2],
        w_gate=gate_up[0],
        w_up=gate_up[1],
        wqkv=wqkv,
        w_gate_up=w_gate_up,
    )


class _TensorReader:
    """Looks tensors up by name and turns them into checked torch tensors on one device."""

    def __init__(self, file: GGUFFile, device: torch.device) -> None:
        self.file = file
        self.device = device
        self.names = set(file.tensor_names())

    def has(self, name: str) -> bool:
        return name in self.names

    def info(self, name: str) -> Mapping[str, Any]:
        if name not in self.names:
            raise GGUFError(f"missing tensor '{name}'")
        return self.file.tensor_info(name)

    def matrix(self, name: str, rows: int, cols: int) -> Linear:
        """A ``rows x cols`` weight (GGUF dims ``[cols, rows]``): Q1_0 packed, F32/F16/BF16 dense."""
        info = self.info(name)
        if tuple(info["dims"]) != (cols, rows):
            raise GGUFError(
                f"tensor '{name}' has shape {list(info['dims'])} (GGUF ne order), expected [{cols}, {rows}]"
            )
        raw = self.file.tensor_bytes(name)
        if info["type"] == "Q1_0":
            try:
                return Q1Weight.from_gguf(raw, rows, cols, self.device)
            except ValueError as e:
                raise GGUFError(f"tensor '{name}': {e}") from e
        values = _widen(name, info["type"], raw, rows * cols)
        return DenseWeight(torch.from_numpy(values.reshape(rows, cols)).to(self.device))

    def vector(self, name: str, length: int) -> torch.Tensor:
        """A float32 vector of ``length`` finite values (stored as F32, F16 or BF16)."""
        info = self.info(name)
        if tuple(info["dims"]) != (length,):
            raise GGUFError(f"tensor '{name}' has shape {list(info['dims'])}, expected [{length}]")
        values = _widen(name, info["type"], self.file.tensor_bytes(name), length)
        if not np.isfinite(values).all():
            bad = values[~np.isfinite(values)][0]
            raise GGUFError(f"tensor '{name}' holds a non-finite value ({bad})")
        return torch.from_numpy(values).to(self.device)


def _widen(name: str, ggml_type: str, raw: np.ndarray, count: int) -> np.ndarray:
    """F32, F16 or BF16 bytes as a new, writable float32 array of ``count`` values."""
    itemsize = {"F32": 4, "F16": 2, "BF16": 2}.get(ggml_type)
    if itemsize is None:
        raise GGUFError(
            f"tensor '{name}' has unsupported tensor type {ggml_type} (expected Q1_0, F32, F16 or BF16)"
        )
    if raw.size != count * itemsize:
        raise GGUFError(f"tensor '{name}' holds {raw.size} bytes, expected {count * itemsize}")
    if ggml_type == "F32":
        return raw.view("<f4").astype(np.float32)
    if ggml_type == "F16":
        return raw.view("<f2").astype(np.float32)
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _vocab_rows(file: GGUFFile) -> int:
    """The vocabulary size: the row count of ``token_embd.weight`` (its full shape is checked on load)."""
    if "token_embd.weight" not in file.tensor_names():
        raise GGUFError("missing tensor 'token_embd.weight'")
    dims = tuple(file.tensor_info("token_embd.weight")["dims"])
    if len(dims) != 2 or dims[1] == 0:
        raise GGUFError(
            f"tensor 'token_embd.weight' has shape {list(dims)} (GGUF ne order), expected [hidden, rows]"
        )
    return int(dims[1])


def _get(meta: Mapping[str, Any], key: str, kind: type, *, required: bool = False) -> Any:
    if key not in meta:
        if required:
            raise GGUFError(f"missing metadata key '{key}'")
        return None
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise GGUFError(f"metadata key '{key}' must be {_KIND_NAMES[kind]}, found {value!r}")
    return value


_KIND_NAMES = {str: "a string", int: "a non-negative integer", float: "a number", (int, float): "a number"}


def _get_int(meta: Mapping[str, Any], name: str, default: int = 0, *, required: bool = False) -> int:
    key = f"{ARCH}.{name}"
    value = _get(meta, key, int, required=required)
    if value is None:
        return default
    if value < 0:
        raise GGUFError(f"metadata key '{key}' must be a non-negative integer, found {value}")
    return int(value)


def _get_float(meta: Mapping[str, Any], name: str, default: float) -> float:
    value = _get(meta, f"{ARCH}.{name}", (int, float))  # type: ignore[arg-type]
    return default if value is None else float(value)


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return int(t.nbytes)

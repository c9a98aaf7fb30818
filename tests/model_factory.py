"""Random-weight Qwen3 GGUF files with Q1_0 weights, laid out the way llama.cpp writes Bonsai models.

`write_qwen3_gguf` writes llama.cpp's tensor names and metadata keys with the `gguf` package, streaming
one tensor at a time so that even Bonsai-1.7B's shapes (`bonsai_1p7b_config()`, ~290 MB) need little
memory. Weights are scaled so a random model stays well conditioned: matrices ~ N(0, s²/in_features),
norm weights ~ 1 ± 0.1, embedding and LM head such that logits have a standard deviation of a few units.
Two ways to make Q1_0 bytes: quantize float weights with ggml's reference rule (`q1_reference.quantize`,
the default for small models), or draw sign bits and fp16 scales directly (`fast_q1`, the default for
large ones; same statistics, much faster). Knobs for error tests: extra or overriding metadata (a value
of None deletes a key), omitted tensors, overridden tensor shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from q1_reference import QK, quantize
from tiny_vocab import tokenizer_metadata

BLOCK_BYTES = 18
Q1_0 = gguf.GGMLQuantizationType.Q1_0
LOGIT_STD = 4.0  # target standard deviation of a random model's logits at weight_scale=1
RESIDUAL_GAIN = 8.0  # out-projections (attn_output, ffn_down) write this much more into the residual
NORM_SPREAD = 0.1  # norm weights ~ N(1, NORM_SPREAD²)
HALF_NORMAL_MEAN = math.sqrt(2 / math.pi)  # E|x| / std: a Q1_0 block's scale for normal weights
FAST_Q1_ABOVE = 20_000_000  # parameters above which fast_q1=None draws bytes directly


@dataclass(frozen=True)
class TinyQwen3Config:
    """Shapes and hyper-parameters; every matrix's in_features must be a multiple of 128 (Q1_0 rows)."""

    vocab_size: int = 384
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 128
    ffn_size: int = 384
    context_length: int = 512
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    name: str = "tiny-qwen3-random"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def bonsai_1p7b_config() -> TinyQwen3Config:
    """Bonsai-1.7B's (Qwen3-1.7B's) shapes."""
    return TinyQwen3Config(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        ffn_size=6144,
        context_length=32768,
        rope_base=1e6,
        rms_eps=1e-6,
        name="bonsai-1.7b-shapes-random",
    )


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: GGUF name, numpy shape (out, in) or (n,), Q1_0 or F32, and its random weights' std."""

    name: str
    shape: tuple[int, ...]
    q1: bool
    std: float


def tensor_specs(cfg: TinyQwen3Config, *, tied: bool = True, weight_scale: float = 1.0) -> list[TensorSpec]:
    """Every tensor of the model in llama.cpp's order and naming."""
    h, v = cfg.hidden_size, cfg.vocab_size
    head_std = weight_scale * LOGIT_STD / (HALF_NORMAL_MEAN * math.sqrt(h))

    def mat(name: str, out_f: int, in_f: int, gain: float = 1.0) -> TensorSpec:
        return TensorSpec(name, (out_f, in_f), True, gain * weight_scale / math.sqrt(in_f))

    def norm(name: str, n: int) -> TensorSpec:
        return TensorSpec(name, (n,), False, NORM_SPREAD)

    specs = [TensorSpec("token_embd.weight", (v, h), True, head_std), norm("output_norm.weight", h)]
    if not tied:
        specs.append(TensorSpec("output.weight", (v, h), True, head_std))
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        specs += [
            norm(b + "attn_norm.weight", h),
            mat(b + "attn_q.weight", cfg.q_size, h),
            mat(b + "attn_k.weight", cfg.kv_size, h),
            mat(b + "attn_v.weight", cfg.kv_size, h),
            mat(b + "attn_output.weight", h, cfg.q_size, RESIDUAL_GAIN),
            norm(b + "attn_q_norm.weight", cfg.head_dim),
            norm(b + "attn_k_norm.weight", cfg.head_dim),
            norm(b + "ffn_norm.weight", h),
            mat(b + "ffn_gate.weight", cfg.ffn_size, h),
            mat(b + "ffn_up.weight", cfg.ffn_size, h),
            mat(b + "ffn_down.weight", h, cfg.ffn_size, RESIDUAL_GAIN),
        ]
    return specs


def q1_byte_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if shape[-1] % QK:
        raise ValueError(f"Q1_0 rows need a multiple of {QK} values, got shape {shape}")
    return (*shape[:-1], shape[-1] // QK * BLOCK_BYTES)


def quantized_bytes(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """ggml's reference quantizer over normal float weights."""
    w = rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(spec.std)
    raw = np.frombuffer(quantize(w), dtype=np.uint8)
    return raw.reshape(q1_byte_shape(spec.shape))


def direct_bytes(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Random sign bits and fp16 scales near what quantizing N(0, std²) gives (E|x| ± 5%)."""
    blocks = math.prod(spec.shape) // QK
    raw = np.frombuffer(rng.bytes(blocks * BLOCK_BYTES), dtype=np.uint8).reshape(blocks, BLOCK_BYTES).copy()
    scale = spec.std * HALF_NORMAL_MEAN * (1 + 0.05 * rng.standard_normal(blocks, dtype=np.float32))
    raw[:, :2] = scale.astype("<f2").view(np.uint8).reshape(blocks, 2)
    return raw.reshape(q1_byte_shape(spec.shape))


def norm_weights(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    return (1 + spec.std * rng.standard_normal(spec.shape)).astype(np.float32)


def add_hparams(writer: gguf.GGUFWriter, cfg: TinyQwen3Config) -> None:
    writer.add_name(cfg.name)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.ffn_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q1_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def value_type(value: Any) -> gguf.GGUFValueType:
    """llama.cpp's choices: counts and ids as uint32 (int32 if negative), floats as float32."""
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32 if value >= 0 else gguf.GGUFValueType.INT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, (list, tuple)):
        return gguf.GGUFValueType.ARRAY
    raise TypeError(f"no GGUF type for {type(value).__name__}")


def add_metadata(writer: gguf.GGUFWriter, entries: dict[str, Any]) -> None:
    """Set (or replace) keys; a value may be `(value, GGUFValueType)` to force a type, or None to delete."""
    for key, value in entries.items():
        if value is None:
            writer.kv_data[0].pop(key, None)
        elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], gguf.GGUFValueType):
            writer.kv_data[0].pop(key, None)
            writer.add_key_value(key, value[0], value[1])
        else:
            writer.kv_data[0].pop(key, None)
            writer.add_key_value(key, list(value) if isinstance(value, tuple) else value, value_type(value))


def planned_tensors(
    specs: list[TensorSpec], omit: Iterable[str], override_shapes: dict[str, tuple[int, ...]]
) -> list[TensorSpec]:
    names = {s.name for s in specs}
    unknown = (set(omit) | set(override_shapes)) - names
    if unknown:
        raise ValueError(f"unknown tensor names {sorted(unknown)}")
    omitted = set(omit)
    return [
        TensorSpec(s.name, tuple(override_shapes.get(s.name, s.shape)), s.q1, s.std)
        for s in specs
        if s.name not in omitted
    ]


def write_tensors(
    writer: gguf.GGUFWriter, specs: list[TensorSpec], make: Callable[[TensorSpec], np.ndarray]
) -> None:
    """Declare every tensor, write the header, then generate and write the tensors one by one."""
    for s in specs:
        if s.q1:
            shape = q1_byte_shape(s.shape)
            writer.add_tensor_info(s.name, shape, np.dtype(np.uint8), math.prod(shape), raw_dtype=Q1_0)
        else:
            writer.add_tensor_info(s.name, s.shape, np.dtype(np.float32), 4 * math.prod(s.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for s in specs:
        writer.write_tensor_data(make(s))


def write_qwen3_gguf(
    path: str | Path,
    cfg: TinyQwen3Config,
    rng: np.random.Generator,
    *,
    tied: bool = True,
    tokenizer_meta: dict[str, Any] | None = None,
    weight_scale: float = 1.0,
    extra_metadata: dict[str, Any] | None = None,
    omit_tensors: Iterable[str] = (),
    override_shapes: dict[str, tuple[int, ...]] | None = None,
    fast_q1: bool | None = None,
) -> None:
    """Write a random Qwen3 model. `tokenizer_meta` replaces the default vocabulary's `tokenizer.*` keys;
    `weight_scale` multiplies every matrix's std (logits scale with it); `fast_q1` None picks the direct
    byte path for models above FAST_Q1_ABOVE parameters."""
    specs = tensor_specs(cfg, tied=tied, weight_scale=weight_scale)
    if fast_q1 is None:
        fast_q1 = sum(math.prod(s.shape) for s in specs) > FAST_Q1_ABOVE
    planned = planned_tensors(specs, omit_tensors, override_shapes or {})
    writer = gguf.GGUFWriter(path, "qwen3")
    try:
        add_hparams(writer, cfg)
        add_metadata(
            writer, tokenizer_meta if tokenizer_meta is not None else tokenizer_metadata(cfg.vocab_size)
        )
        add_metadata(writer, extra_metadata or {})
        q1_maker = direct_bytes if fast_q1 else quantized_bytes
        write_tensors(writer, planned, lambda s: q1_maker(s, rng) if s.q1 else norm_weights(s, rng))
    finally:
        writer.close()

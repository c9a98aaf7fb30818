"""An independent numpy Qwen3 forward pass, the yardstick for oxibonsai's Rust model.

Written from the Qwen3 definition (HF transformers' `modeling_qwen3`, llama.cpp's qwen3 graph), never
from our Rust code, and reading the GGUF with `gguf.GGUFReader` rather than our reader. Q1_0 weights are
dequantized exactly to float32 (`q1_reference.dequantize`); all arithmetic after that is float64, and
`logits` rounds the result to float32 once at the end. It recomputes the whole sequence for every call
(no KV cache): slow, and simple enough to check by reading. Meant for tiny models: every weight is held
dequantized in memory.

Per layer, with x the residual stream (rows are positions 0..n-1):
    h = rmsnorm(x) * attn_norm;  q, k, v = h @ Wq.T, h @ Wk.T, h @ Wv.T, split into heads
    q, k = rmsnorm_per_head(q) * q_norm, rmsnorm_per_head(k) * k_norm     (before RoPE)
    q, k = rope_neox(q), rope_neox(k)       x*cos + rotate_half(x)*sin, inv_freq = base^(-2i/head_dim)
                                            (YaRN / linear rope scaling: `rope_inv_freq`)
    query head j reads KV head j // (heads / kv_heads); causal softmax(q k^T / sqrt(head_dim)) v
    x += concat(heads) @ Wo.T;  h = rmsnorm(x) * ffn_norm;  x += (silu(h Wg.T) * (h Wu.T)) @ Wd.T
then logits = (rmsnorm(x) * output_norm) @ (output or token_embd).T.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from q1_reference import dequantize, dequantized, quantize_activations, quantize_activations_int8

ARCH = "qwen3"


@dataclass(frozen=True)
class Qwen3Hparams:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    rope_base: float
    rms_eps: float
    rope_scaling: dict[str, Any] | None = None  # Hugging Face's rope_scaling dict, from rope.scaling.*


def read_hparams(reader: gguf.GGUFReader) -> Qwen3Hparams:
    def get(key: str) -> Any:
        field = reader.get_field(key)
        if field is None:
            raise KeyError(key)
        return field.contents()

    arch = get("general.architecture")
    if arch != ARCH:
        raise ValueError(f"not a qwen3 model: {arch}")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return Qwen3Hparams(
        vocab_size=int(embd.shape[1]),  # ne = [hidden, vocab]: the embedding's rows define the vocabulary
        hidden_size=int(get(f"{ARCH}.embedding_length")),
        num_layers=int(get(f"{ARCH}.block_count")),
        num_heads=int(get(f"{ARCH}.attention.head_count")),
        num_kv_heads=int(get(f"{ARCH}.attention.head_count_kv")),
        head_dim=int(get(f"{ARCH}.attention.key_length")),
        ffn_size=int(get(f"{ARCH}.feed_forward_length")),
        rope_base=float(get(f"{ARCH}.rope.freq_base")),
        rms_eps=float(get(f"{ARCH}.attention.layer_norm_rms_epsilon")),
        rope_scaling=read_rope_scaling(reader),
    )


def read_rope_scaling(reader: gguf.GGUFReader) -> dict[str, Any] | None:
    """llama.cpp's `{arch}.rope.scaling.*` keys as Hugging Face's `rope_scaling` dict."""

    def get(name: str, default: Any = None) -> Any:
        field = reader.get_field(f"{ARCH}.rope.scaling.{name}")
        return default if field is None else field.contents()

    kind = get("type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": float(get("factor"))}
    if kind == "yarn":
        context = reader.get_field(f"{ARCH}.context_length").contents()
        scaling["original_max_position_embeddings"] = int(get("original_context_length", context))
        scaling["beta_fast"] = float(get("yarn_beta_fast", 32.0))
        scaling["beta_slow"] = float(get("yarn_beta_slow", 1.0))
        scaling["attention_factor"] = float(get("yarn_attn_factor", 1.0)) * (
            0.1 * np.log(scaling["factor"]) + 1
        )
    return scaling


def read_weights(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    """Every tensor as float64 in numpy layout: matrices (out_features, in_features), vectors (n,)."""
    weights = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # ne is [in, out]; numpy rows are out
        if t.tensor_type == gguf.GGMLQuantizationType.Q1_0:
            rows, cols = int(np.prod(shape[:-1])), shape[-1]
            w = dequantize(np.ascontiguousarray(t.data).tobytes(), rows, cols).reshape(shape)
        elif t.tensor_type == gguf.GGMLQuantizationType.F32:
            w = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            raise ValueError(f"{t.name}: unexpected type {t.tensor_type.name}")
        weights[t.name] = w.astype(np.float64)
    return weights


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Over the last axis: x / sqrt(mean(x²) + eps) * weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_tables(
    positions: np.ndarray, head_dim: int, base: float, scaling: dict[str, Any] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (n, head_dim): angle pos * inv_freq (`rope_inv_freq`), repeated for both
    halves, times the scaling's attention factor."""
    inv_freq, attention = rope_inv_freq(head_dim, base, scaling)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles) * attention, np.sin(angles) * attention


def rope_inv_freq(
    head_dim: int, base: float, scaling: dict[str, Any] | None = None
) -> tuple[np.ndarray, float]:
    """base^(-2i/head_dim), stretched as HF transformers' `_compute_{linear,yarn}_parameters` do, and the
    attention factor. YaRN: pair i's wavelength turns `rotations(i)` times over the original context;
    the pairs from floor(dim where beta_fast turns) to ceil(dim where beta_slow turns) blend linearly
    from the original frequency to frequency / factor."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None or scaling["rope_type"] == "default":
        return inv_freq, 1.0
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor, 1.0
    assert scaling["rope_type"] == "yarn"
    original = scaling["original_max_position_embeddings"]

    def dim_turning(
        turns: float,
    ) -> float:  # the (fractional) pair index whose wavelength turns `turns` times
        return head_dim * np.log(original / (turns * 2 * np.pi)) / (2 * np.log(base))

    low = max(np.floor(dim_turning(scaling.get("beta_fast", 32.0))), 0)
    high = min(np.ceil(dim_turning(scaling.get("beta_slow", 1.0))), head_dim - 1)
    span = high - low if high != low else 1e-3  # HF: `if min == max: max += 0.001`
    ramp = np.clip((np.arange(head_dim // 2) - low) / span, 0, 1)  # 0: keep, 1: interpolate
    blended = inv_freq * (1 - ramp) + (inv_freq / factor) * ramp
    attention = scaling.get("attention_factor") or (0.1 * np.log(factor) + 1 if factor > 1 else 1.0)
    return blended, float(attention)


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: (heads, n, head_dim). Rotates the pairs (i, i + head_dim/2): x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q: (heads, n, d), k and v: (kv_heads, n, d) -> (heads, n, d), grouped-query, causal."""
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # query head j -> KV head j // group
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    n = q.shape[1]
    scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs @ v


class ReferenceQwen3:
    """Qwen3 logits from float64 weights keyed by GGUF tensor names (see the module doc for the math)."""

    def __init__(self, hp: Qwen3Hparams, weights: dict[str, np.ndarray]) -> None:
        self.hp = hp
        self.w = weights
        self.lm_head_name = "output.weight" if "output.weight" in weights else "token_embd.weight"

    @classmethod
    def from_gguf(cls, path: str | Path) -> ReferenceQwen3:
        reader = gguf.GGUFReader(path)
        return cls(read_hparams(reader), read_weights(reader))

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T for the matrix `name` (tests override this to model activation quantization)."""
        return x @ self.w[name].T

    def heads(self, x: np.ndarray, count: int) -> np.ndarray:
        """(n, count * head_dim) -> (count, n, head_dim)."""
        return x.reshape(x.shape[0], count, self.hp.head_dim).transpose(1, 0, 2)

    def attention(self, x: np.ndarray, i: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        hp, w, p = self.hp, self.w, f"blk.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], hp.rms_eps)
        q = self.heads(self.linear(h, p + "attn_q.weight"), hp.num_heads)
        k = self.heads(self.linear(h, p + "attn_k.weight"), hp.num_kv_heads)
        v = self.heads(self.linear(h, p + "attn_v.weight"), hp.num_kv_heads)
        q = rope_neox(rms_norm(q, w[p + "attn_q_norm.weight"], hp.rms_eps), cos, sin)
        k = rope_neox(rms_norm(k, w[p + "attn_k_norm.weight"], hp.rms_eps), cos, sin)
        out = causal_attention(q, k, v).transpose(1, 0, 2).reshape(x.shape[0], -1)
        return self.linear(out, p + "attn_output.weight")

    def mlp(self, x: np.ndarray, i: int) -> np.ndarray:
        w, p = self.w, f"blk.{i}."
        h = rms_norm(x, w[p + "ffn_norm.weight"], self.hp.rms_eps)
        gate, up = self.linear(h, p + "ffn_gate.weight"), self.linear(h, p + "ffn_up.weight")
        return self.linear(silu(gate) * up, p + "ffn_down.weight")

    def hidden_states(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """The final residual stream (n, hidden) before output_norm, float64."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= self.hp.vocab_size:
            raise ValueError("token_ids must be a non-empty 1-D sequence of ids below the vocabulary size")
        cos, sin = rope_tables(np.arange(ids.size), self.hp.head_dim, self.hp.rope_base, self.hp.rope_scaling)
        x = self.w["token_embd.weight"][ids]
        for i in range(self.hp.num_layers):
            x = x + self.attention(x, i, cos, sin)
            x = x + self.mlp(x, i)
        return x

    def logits64(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """float64 (len(token_ids), vocab): the logits at every position."""
        x = rms_norm(self.hidden_states(token_ids), self.w["output_norm.weight"], self.hp.rms_eps)
        return self.linear(x, self.lm_head_name)

    def logits(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """float32 (len(token_ids), vocab): `logits64` rounded once."""
        return self.logits64(token_ids).astype(np.float32)

    def greedy(self, prompt_ids: list[int], n: int) -> list[int]:
        """n greedily generated ids (argmax; ties go to the lowest id), recomputing the sequence each step."""
        ids = list(prompt_ids)
        for _ in range(n):
            ids.append(int(np.argmax(self.logits64(ids)[-1])))
        return ids[len(prompt_ids) :]


class QuantizedActivationQwen3(ReferenceQwen3):
    """The reference with every matmul input rounded the way the kernels round it (int16 per 128
    values with an L1-bounded scale, `q1_reference.quantize_activations`): the deviation a correct
    quantized forward pass can show. It models the expected error size, not our kernels' exact
    arithmetic."""

    quantize = staticmethod(quantize_activations)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return dequantized(*self.quantize(x.astype(np.float32))) @ self.w[name].T


class Int8ActivationQwen3(QuantizedActivationQwen3):
    """The same with the int8 rule the kernels used before issue 26 (per 128 values, scale amax/127),
    for comparisons."""

    quantize = staticmethod(quantize_activations_int8)

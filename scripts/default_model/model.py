"""The default model in torch: Qwen3 blocks (GQA, per-head q/k RMSNorm, rotate-half RoPE, SwiGLU,
tied embedding) whose every matrix and the embedding run through Q1_0 in the forward pass.

``q1_weight`` is the quantizer of the shipped file, so the trained forward *is* the exported model:
per 128 consecutive weights of a row, scale d = mean|w| rounded to fp16 (nearest even) and each weight
replaced by +d (w >= 0) or -d. The gradient passes straight through (STE) to the latent fp32 weights.
With ``quantized=False`` the same model trains in full precision, for the comparison in the log.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

QK = 128


@dataclass(frozen=True)
class Config:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn_size: int = 768
    context_length: int = 512
    rope_base: float = 10000.0
    rms_eps: float = 1e-6

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def q1_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales as fp16 (rows, cols/128), signs as bool (rows, cols)): the Q1_0 encoding of ``w``."""
    rows, cols = w.shape
    blocks = w.detach().float().reshape(rows, cols // QK, QK)
    scales = blocks.abs().mean(dim=-1).half()
    return scales, (w.detach() >= 0)


def q1_weight(w: torch.Tensor) -> torch.Tensor:
    """The Q1_0 dequantized weight, with a straight-through gradient to ``w``."""
    scales, signs = q1_parts(w)
    d = scales.float().repeat_interleave(QK, dim=1)
    q = torch.where(signs, d, -d)
    return w + (q - w).detach()


class QLinear(nn.Module):
    """y = x @ W.T with W quantized to Q1_0 in the forward pass (unless ``quantized`` is off)."""

    def __init__(self, in_features: int, out_features: int, quantized: bool) -> None:
        super().__init__()
        if in_features % QK:
            raise ValueError(f"in_features must be a multiple of {QK}, got {in_features}")
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.quantized = quantized

    def effective_weight(self) -> torch.Tensor:
        return q1_weight(self.weight) if self.quantized else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective_weight())


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def rope_tables(n: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, n, head_dim); rotate-half (NEOX) RoPE."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Block(nn.Module):
    def __init__(self, c: Config, quantized: bool) -> None:
        super().__init__()
        self.c = c
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.q = QLinear(c.hidden_size, c.num_heads * c.head_dim, quantized)
        self.k = QLinear(c.hidden_size, c.num_kv_heads * c.head_dim, quantized)
        self.v = QLinear(c.hidden_size, c.num_kv_heads * c.head_dim, quantized)
        self.o = QLinear(c.num_heads * c.head_dim, c.hidden_size, quantized)
        self.q_norm = RMSNorm(c.head_dim, c.rms_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.gate = QLinear(c.hidden_size, c.ffn_size, quantized)
        self.up = QLinear(c.hidden_size, c.ffn_size, quantized)
        self.down = QLinear(c.ffn_size, c.hidden_size, quantized)

    def heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, count, self.c.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        h = self.attn_norm(x)
        q = rope(self.q_norm(self.heads(self.q(h), c.num_heads)), cos, sin)
        k = rope(self.k_norm(self.heads(self.k(h), c.num_kv_heads)), cos, sin)
        v = self.heads(self.v(h), c.num_kv_heads)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Qwen3(nn.Module):
    def __init__(self, c: Config, quantized: bool = True) -> None:
        super().__init__()
        if c.hidden_size % QK:
            raise ValueError(f"hidden_size must be a multiple of {QK}")
        self.c = c
        self.quantized = quantized
        self.embed = nn.Parameter(torch.randn(c.vocab_size, c.hidden_size) / math.sqrt(c.hidden_size))
        self.blocks = nn.ModuleList(Block(c, quantized) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        cos, sin = rope_tables(c.context_length, c.head_dim, c.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def embedding(self) -> torch.Tensor:
        return q1_weight(self.embed) if self.quantized else self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (batch, n) -> logits (batch, n, vocab); the LM head is the (quantized) embedding."""
        n = ids.shape[1]
        table = self.embedding()
        x = table[ids]
        cos, sin = self.cos[:n], self.sin[:n]
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), table)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

"""Every size one mode uses: the model shapes and the ``Plan`` of the GPU run and of the CPU smoke run."""

from __future__ import annotations

from dataclasses import dataclass

from oxibonsai.torch_backend.weights import Qwen3Config

SEED = 0
GIB = 1 << 30


def qwen3(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> Qwen3Config:
    return Qwen3Config(layers, hidden, ffn, heads, kv_heads, 128, vocab, 32768, 1e6, 1e-6)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: Qwen3Config
    tied: bool


BONSAI_1P7B = ModelSpec("bonsai-1.7b", qwen3(28, 2048, 6144, 16, 8, 151936), tied=True)
BONSAI_8B = ModelSpec("bonsai-8b", qwen3(36, 4096, 12288, 32, 8, 151936), tied=False)
TINY_TIED = ModelSpec("tiny-tied", qwen3(2, 256, 384, 4, 2, 384), tied=True)
TINY_UNTIED = ModelSpec("tiny-untied", qwen3(2, 256, 384, 4, 2, 384), tied=False)


@dataclass(frozen=True)
class Plan:
    """Every size one mode uses: the GPU run or the CPU smoke run."""

    device: str
    models: tuple[ModelSpec, ...]
    q1_roles: tuple[str, ...]
    q1_m: tuple[int, ...]
    batches: tuple[int, ...]
    context: int
    decode_steps: int
    prefill_tokens: int
    copy_bytes: int
    promote_blocks: int
    ttft_prefix: int
    ttft_tail: int
    ttft_repeats: int
    warmup: int
    reps: int
    engine_tokens: int = 64  # generated per request in the engine section
    rotate_bytes: int = 256 << 20  # weight copies cycled through when timing, to stay out of L2
    max_copies: int = 512


GPU_PLAN = Plan(
    device="cuda", models=(BONSAI_1P7B, BONSAI_8B), q1_roles=("qkv", "o", "gate_up", "down", "head"),
    q1_m=(1, 16, 64, 512, 4), batches=(1, 16, 64), context=512, decode_steps=16, prefill_tokens=512,
    copy_bytes=GIB, promote_blocks=64, ttft_prefix=1024, ttft_tail=16, ttft_repeats=3, warmup=2, reps=10,
    engine_tokens=128,
)  # fmt: skip
SMOKE_PLAN = Plan(
    device="cpu", models=(TINY_TIED, TINY_UNTIED), q1_roles=("gate_up", "down"), q1_m=(1, 16, 4),
    batches=(1, 16), context=32, decode_steps=2, prefill_tokens=32, copy_bytes=16 << 20, promote_blocks=8,
    ttft_prefix=64, ttft_tail=16, ttft_repeats=1, warmup=1, reps=2, max_copies=1, engine_tokens=4,
)  # fmt: skip

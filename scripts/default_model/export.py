"""Writes the trained model as a Bonsai-format GGUF: Q1_0 matrices and embedding (tied LM head), f32
norms, llama.cpp's Qwen3 tensor names and metadata keys, the tokenizer, and ``oxibonsai.*`` keys that
record what it was trained on and the bits per byte the training script measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from model import QK, Qwen3, q1_parts

BLOCK_BYTES = 2 + QK // 8


def q1_bytes(w: torch.Tensor) -> np.ndarray:
    """ggml Q1_0 bytes of ``w`` (rows, cols) exactly as ``q1_weight`` sees it: per 128 weights an fp16
    little-endian scale, then 16 bytes of sign bits (bit j%8 of byte j/8 set means +d)."""
    scales, signs = q1_parts(w)
    rows, cols = signs.shape
    nblocks = cols // QK
    bits = np.packbits(signs.numpy().reshape(rows, nblocks, QK), axis=-1, bitorder="little")
    scale_bytes = scales.numpy().astype("<f2").view(np.uint8).reshape(rows, nblocks, 2)
    return np.concatenate([scale_bytes, bits], axis=-1).reshape(rows, nblocks * BLOCK_BYTES)


def named_tensors(model: Qwen3) -> list[tuple[str, torch.Tensor, bool]]:
    """(GGUF name, tensor, is Q1_0) in llama.cpp's order."""
    out = [("token_embd.weight", model.embed, True), ("output_norm.weight", model.norm.weight, False)]
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", b.attn_norm.weight, False),
            (p + "attn_q.weight", b.q.weight, True),
            (p + "attn_k.weight", b.k.weight, True),
            (p + "attn_v.weight", b.v.weight, True),
            (p + "attn_output.weight", b.o.weight, True),
            (p + "attn_q_norm.weight", b.q_norm.weight, False),
            (p + "attn_k_norm.weight", b.k_norm.weight, False),
            (p + "ffn_norm.weight", b.ffn_norm.weight, False),
            (p + "ffn_gate.weight", b.gate.weight, True),
            (p + "ffn_up.weight", b.up.weight, True),
            (p + "ffn_down.weight", b.down.weight, True),
        ]
    return out


def _add_hparams(writer: gguf.GGUFWriter, model: Qwen3, name: str) -> None:
    c = model.c
    writer.add_name(name)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.ffn_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_base)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q1_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_metadata(writer: gguf.GGUFWriter, entries: dict[str, Any]) -> None:
    for key, value in entries.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif value and isinstance(value[0], str):
            writer.add_array(key, list(value))
        else:
            writer.add_key_value(
                key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32
            )


def write_gguf(
    path: Path, model: Qwen3, name: str, tokenizer_meta: dict[str, Any], extra: dict[str, Any]
) -> None:
    if not model.quantized:
        raise ValueError("only the 1-bit model is exported")
    writer = gguf.GGUFWriter(path, "qwen3")
    try:
        _add_hparams(writer, model, name)
        _add_metadata(writer, tokenizer_meta)
        _add_metadata(writer, extra)
        with torch.no_grad():
            for tensor_name, t, quantized in named_tensors(model):
                data = q1_bytes(t) if quantized else t.detach().float().numpy()
                if quantized:
                    writer.add_tensor(tensor_name, data, raw_dtype=gguf.GGMLQuantizationType.Q1_0)
                else:
                    writer.add_tensor(tensor_name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()

"""The random-model factory writes what llama.cpp writes: names, GGUF shapes and types, metadata keys
and types, a valid byte-level BPE vocabulary, and weights at the intended scale. Read back with
`gguf.GGUFReader`; none of this needs oxibonsai's own code."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from model_factory import (
    HALF_NORMAL_MEAN,
    TinyQwen3Config,
    bonsai_1p7b_config,
    q1_byte_shape,
    tensor_specs,
    write_qwen3_gguf,
)
from q1_reference import dequantize
from tiny_vocab import CONTROL, ENDOFTEXT, IM_END, IM_START, bytes_to_unicode, tokenizer_metadata

Q1_0, F32 = gguf.GGMLQuantizationType.Q1_0, gguf.GGMLQuantizationType.F32
CFG = TinyQwen3Config()


def written(path: Path, rng: np.random.Generator, **kwargs: object) -> gguf.GGUFReader:
    write_qwen3_gguf(path, CFG, rng, **kwargs)  # type: ignore[arg-type]
    return gguf.GGUFReader(path)


def field(reader: gguf.GGUFReader, key: str) -> object:
    f = reader.get_field(key)
    assert f is not None, key
    return f.contents()


def expected_tensors(
    cfg: TinyQwen3Config, tied: bool
) -> dict[str, tuple[list[int], gguf.GGMLQuantizationType]]:
    """GGUF ne order: [in_features, out_features] for matrices."""
    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.ffn_size
    out = {"token_embd.weight": ([h, cfg.vocab_size], Q1_0), "output_norm.weight": ([h], F32)}
    if not tied:
        out["output.weight"] = ([h, cfg.vocab_size], Q1_0)
    for i in range(cfg.num_layers):
        out |= {
            f"blk.{i}.attn_norm.weight": ([h], F32),
            f"blk.{i}.attn_q.weight": ([h, q], Q1_0),
            f"blk.{i}.attn_k.weight": ([h, kv], Q1_0),
            f"blk.{i}.attn_v.weight": ([h, kv], Q1_0),
            f"blk.{i}.attn_output.weight": ([q, h], Q1_0),
            f"blk.{i}.attn_q_norm.weight": ([cfg.head_dim], F32),
            f"blk.{i}.attn_k_norm.weight": ([cfg.head_dim], F32),
            f"blk.{i}.ffn_norm.weight": ([h], F32),
            f"blk.{i}.ffn_gate.weight": ([h, f], Q1_0),
            f"blk.{i}.ffn_up.weight": ([h, f], Q1_0),
            f"blk.{i}.ffn_down.weight": ([f, h], Q1_0),
        }
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_tensors_have_llama_cpp_names_shapes_and_types(tmp_path: Path, rng: np.random.Generator, tied: bool):
    reader = written(tmp_path / "m.gguf", rng, tied=tied)
    got = {t.name: ([int(d) for d in t.shape], t.tensor_type) for t in reader.tensors}
    assert got == expected_tensors(CFG, tied)
    for t in reader.tensors:
        if t.tensor_type == Q1_0:
            assert t.data.dtype == np.uint8
            assert t.data.shape == (int(t.shape[1]), int(t.shape[0]) // 128 * 18)
            assert t.n_bytes == t.n_elements // 128 * 18


def test_hparams_use_llama_cpp_keys_and_types(tmp_path: Path, rng: np.random.Generator):
    reader = written(tmp_path / "m.gguf", rng)
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    expected = {
        "qwen3.block_count": (CFG.num_layers, u32),
        "qwen3.context_length": (CFG.context_length, u32),
        "qwen3.embedding_length": (CFG.hidden_size, u32),
        "qwen3.feed_forward_length": (CFG.ffn_size, u32),
        "qwen3.attention.head_count": (CFG.num_heads, u32),
        "qwen3.attention.head_count_kv": (CFG.num_kv_heads, u32),
        "qwen3.attention.key_length": (CFG.head_dim, u32),
        "qwen3.attention.value_length": (CFG.head_dim, u32),
        "qwen3.rope.freq_base": (CFG.rope_base, f32),
        "qwen3.attention.layer_norm_rms_epsilon": (np.float32(CFG.rms_eps), f32),
    }
    for key, (value, vtype) in expected.items():
        f = reader.get_field(key)
        assert f is not None and f.types == [vtype], key
        assert f.contents() == value, key
    assert field(reader, "general.architecture") == "qwen3"
    assert field(reader, "general.name") == CFG.name


def test_default_vocabulary_is_a_valid_byte_level_bpe(tmp_path: Path, rng: np.random.Generator):
    reader = written(tmp_path / "m.gguf", rng)
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = field(reader, "tokenizer.ggml.merges")
    assert isinstance(tokens, list) and isinstance(types, list) and isinstance(merges, list)
    assert len(tokens) == len(types) == CFG.vocab_size == len(set(tokens))
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "qwen2"
    assert field(reader, "tokenizer.ggml.eos_token_id") == tokens.index(IM_END)
    assert field(reader, "tokenizer.ggml.padding_token_id") == tokens.index(ENDOFTEXT)
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert [tokens[i] for i, t in enumerate(types) if t == CONTROL] == [ENDOFTEXT, IM_START, IM_END]
    assert tokens[:256] == list(bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in pairs)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    enc = tok.encode("Hello world, the end ünïcode")
    assert enc.tokens[:2] == ["Hello", "Ġworld"]
    assert tok.decode(enc.ids) == "Hello world, the end ünïcode"
    assert "im_start" in str(field(reader, "tokenizer.chat_template"))


def test_vocabulary_larger_than_the_model_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        tokenizer_metadata(100)


@pytest.mark.parametrize("fast_q1", [False, True])
def test_weights_have_the_intended_scale(tmp_path: Path, rng: np.random.Generator, fast_q1: bool):
    reader = written(tmp_path / "m.gguf", rng, tied=False, fast_q1=fast_q1)
    specs = {s.name: s for s in tensor_specs(CFG, tied=False)}
    for t in reader.tensors:
        spec = specs[t.name]
        if t.tensor_type == Q1_0:
            w = dequantize(t.data.tobytes(), *spec.shape)
            rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
            assert rms == pytest.approx(spec.std * HALF_NORMAL_MEAN, rel=0.05), t.name
            assert 0.4 < np.mean(w > 0) < 0.6
        else:
            assert np.mean(t.data) == pytest.approx(1.0, abs=0.05) and 0.05 < np.std(t.data) < 0.15


def test_metadata_overrides_omissions_and_shape_overrides(tmp_path: Path, rng: np.random.Generator):
    reader = written(
        tmp_path / "m.gguf",
        rng,
        extra_metadata={
            "qwen3.attention.head_count": 3,
            "qwen3.rope.freq_base": None,
            "custom.flag": (7, gguf.GGUFValueType.UINT64),
        },
        omit_tensors=["blk.1.ffn_up.weight"],
        override_shapes={"blk.0.attn_q.weight": (256, 256)},
    )
    assert field(reader, "qwen3.attention.head_count") == 3
    assert reader.get_field("qwen3.rope.freq_base") is None
    f = reader.get_field("custom.flag")
    assert f is not None and f.types == [gguf.GGUFValueType.UINT64] and f.contents() == 7
    names = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    assert "blk.1.ffn_up.weight" not in names and names["blk.0.attn_q.weight"] == [256, 256]
    with pytest.raises(ValueError, match="unknown tensor"):
        write_qwen3_gguf(tmp_path / "x.gguf", CFG, rng, omit_tensors=["blk.9.nope"])
    with pytest.raises(ValueError, match="multiple of 128"):
        write_qwen3_gguf(tmp_path / "y.gguf", CFG, rng, override_shapes={"blk.0.attn_q.weight": (512, 100)})


def test_bonsai_1p7b_config_is_qwen3_1p7b_and_about_290_mb():
    cfg = bonsai_1p7b_config()
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2048, 28, 16, 8)
    assert (cfg.head_dim, cfg.ffn_size, cfg.vocab_size, cfg.context_length) == (128, 6144, 151936, 32768)
    for tied, lo, hi in ((True, 230e6, 260e6), (False, 270e6, 300e6)):
        specs = tensor_specs(cfg, tied=tied)
        size = sum(math.prod(q1_byte_shape(s.shape)) if s.q1 else 4 * math.prod(s.shape) for s in specs)
        assert lo < size < hi

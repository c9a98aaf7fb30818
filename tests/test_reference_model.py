"""The numpy Qwen3 reference checked against things that do not share its code: a second, incremental
formulation (a per-token loop with a KV cache and RoPE as complex rotation), hand-derived cases,
and invariances (causality, GQA = MHA on duplicated K/V weights, RoPE's relative-position property).
Also measures what oxibonsai's tests need to choose tolerances: the gap between the top two logits of
random models, and how far the kernels' activation rounding moves the logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model_factory import TinyQwen3Config, write_qwen3_gguf
from qwen3_reference import (
    QuantizedActivationQwen3,
    Qwen3Hparams,
    ReferenceQwen3,
    rms_norm,
    rope_neox,
    rope_tables,
)

CFG = TinyQwen3Config()


def tiny_model(tmp_path: Path, rng: np.random.Generator, cfg: TinyQwen3Config = CFG, **kw: object):
    path = tmp_path / "tiny.gguf"
    write_qwen3_gguf(path, cfg, rng, **kw)  # type: ignore[arg-type]
    return ReferenceQwen3.from_gguf(path)


def rope_complex(x: np.ndarray, pos: int, base: float) -> np.ndarray:
    """NEOX RoPE as complex multiplication: pair (i, i + d/2) is the number x_i + i x_(i+d/2)."""
    half = x.shape[-1] // 2
    z = (x[:half] + 1j * x[half:]) * np.exp(1j * pos * base ** (-2 * np.arange(half) / x.shape[-1]))
    return np.concatenate([z.real, z.imag])


def attend_one(
    m: ReferenceQwen3, i: int, x: np.ndarray, pos: int, cache: list[list[np.ndarray]]
) -> np.ndarray:
    """Layer i's attention output for one token at `pos`, appending its (keys, values) per KV head."""
    hp, w, p = m.hp, m.w, f"blk.{i}."
    d, group = hp.head_dim, hp.num_heads // hp.num_kv_heads
    h = rms_norm(x, w[p + "attn_norm.weight"], hp.rms_eps)
    q, k, v = (w[p + f"attn_{n}.weight"] @ h for n in "qkv")
    k_heads = [
        rms_norm(k[j * d : (j + 1) * d], w[p + "attn_k_norm.weight"], hp.rms_eps)
        for j in range(hp.num_kv_heads)
    ]
    cache.append([np.stack([rope_complex(kj, pos, hp.rope_base) for kj in k_heads]), v.reshape(-1, d)])
    heads = []
    for j in range(hp.num_heads):
        qj = rms_norm(q[j * d : (j + 1) * d], w[p + "attn_q_norm.weight"], hp.rms_eps)
        qj = rope_complex(qj, pos, hp.rope_base)
        scores = np.array([qj @ keys[j // group] for keys, _ in cache]) / np.sqrt(d)
        a = np.exp(scores - scores.max())
        heads.append(sum(ai * values[j // group] for ai, (_, values) in zip(a / a.sum(), cache, strict=True)))
    return w[p + "attn_output.weight"] @ np.concatenate(heads)


def incremental_logits(m: ReferenceQwen3, ids: list[int]) -> np.ndarray:
    """Token by token with a KV cache, one head at a time: how an inference engine computes it."""
    hp, w = m.hp, m.w
    caches: list[list[list[np.ndarray]]] = [[] for _ in range(hp.num_layers)]
    out = []
    for pos, tok in enumerate(ids):
        x = w["token_embd.weight"][tok].copy()
        for i, cache in enumerate(caches):
            x = x + attend_one(m, i, x, pos, cache)
            h = rms_norm(x, w[f"blk.{i}.ffn_norm.weight"], hp.rms_eps)
            g, u = w[f"blk.{i}.ffn_gate.weight"] @ h, w[f"blk.{i}.ffn_up.weight"] @ h
            x = x + w[f"blk.{i}.ffn_down.weight"] @ (g / (1 + np.exp(-g)) * u)
        out.append(w[m.lm_head_name] @ rms_norm(x, w["output_norm.weight"], hp.rms_eps))
    return np.array(out)


def test_matches_an_incremental_kv_cache_formulation(tmp_path: Path, rng: np.random.Generator):
    m = tiny_model(tmp_path, rng, tied=False)
    ids = rng.integers(0, CFG.vocab_size, 12).tolist()
    np.testing.assert_allclose(m.logits64(ids), incremental_logits(m, ids), rtol=0, atol=1e-9)


def test_one_token_needs_no_rope_or_softmax(tmp_path: Path, rng: np.random.Generator):
    """At position 0 each head's attention output is its value vector exactly (derived by hand)."""
    m = tiny_model(tmp_path, rng)
    w, hp, tok = m.w, m.hp, int(rng.integers(CFG.vocab_size))
    x = w["token_embd.weight"][tok]
    for i in range(hp.num_layers):
        p = f"blk.{i}."
        h = x / np.sqrt(np.mean(x**2) + hp.rms_eps) * w[p + "attn_norm.weight"]
        v = (w[p + "attn_v.weight"] @ h).reshape(hp.num_kv_heads, hp.head_dim)
        x = x + w[p + "attn_output.weight"] @ np.repeat(v, hp.num_heads // hp.num_kv_heads, axis=0).ravel()
        h = x / np.sqrt(np.mean(x**2) + hp.rms_eps) * w[p + "ffn_norm.weight"]
        g = w[p + "ffn_gate.weight"] @ h
        x = x + w[p + "ffn_down.weight"] @ (g * (1 / (1 + np.exp(-g))) * (w[p + "ffn_up.weight"] @ h))
    x = x / np.sqrt(np.mean(x**2) + hp.rms_eps) * w["output_norm.weight"]
    np.testing.assert_allclose(m.logits64([tok])[0], w["token_embd.weight"] @ x, rtol=0, atol=1e-9)


def test_logits_are_finite_float32_and_of_order_one_to_ten(tmp_path: Path, rng: np.random.Generator):
    m = tiny_model(tmp_path, rng, tied=bool(rng.integers(2)))
    logits = m.logits(rng.integers(0, CFG.vocab_size, 40))
    assert logits.dtype == np.float32 and logits.shape == (40, CFG.vocab_size)
    assert np.isfinite(logits).all()
    assert 1 < logits.std() < 10 and np.abs(logits).max() < 60


def test_causal_earlier_logits_ignore_later_tokens(tmp_path: Path, rng: np.random.Generator):
    m = tiny_model(tmp_path, rng)
    ids = rng.integers(0, CFG.vocab_size, 20)
    changed = ids.copy()
    changed[12:] = rng.integers(0, CFG.vocab_size, 8)
    a, b = m.logits64(ids), m.logits64(changed)
    np.testing.assert_array_equal(a[:12], b[:12])
    assert not np.allclose(a[12:], b[12:])


def test_gqa_equals_mha_on_duplicated_kv_weights(tmp_path: Path, rng: np.random.Generator):
    gqa = tiny_model(tmp_path, rng)
    group, d = CFG.num_heads // CFG.num_kv_heads, CFG.head_dim
    w = dict(gqa.w)
    for i in range(CFG.num_layers):
        for n in ("attn_k", "attn_v"):
            heads = w[f"blk.{i}.{n}.weight"].reshape(CFG.num_kv_heads, d, -1)
            w[f"blk.{i}.{n}.weight"] = np.repeat(heads, group, axis=0).reshape(CFG.num_heads * d, -1)
    hp = gqa.hp
    mha = ReferenceQwen3(Qwen3Hparams(**{**hp.__dict__, "num_kv_heads": hp.num_heads}), w)
    ids = rng.integers(0, CFG.vocab_size, 16)
    np.testing.assert_allclose(gqa.logits64(ids), mha.logits64(ids), rtol=0, atol=1e-10)


def test_rope_is_a_relative_rotation(rng: np.random.Generator):
    d, base = 128, 1e6
    x = rng.standard_normal((2, 1, d))
    cos, sin = rope_tables(np.arange(40), d, base)
    rotated = rope_neox(np.repeat(x, 40, axis=1), cos, sin)  # (2, 40, d): x rotated to every position
    np.testing.assert_allclose(rotated[:, 0], x[:, 0], atol=1e-15)  # position 0 is the identity
    for pos in (1, 7, 39):
        np.testing.assert_allclose(rotated[0, pos], rope_complex(x[0, 0], pos, base), atol=1e-12)
    scores = rotated[0] @ rotated[1].T  # q at m, k at n: depends on m - n only
    np.testing.assert_allclose(scores[5, 2], scores[30, 27], rtol=1e-10)
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1).repeat(40, 1))


def test_rms_norm_by_hand():
    out = rms_norm(np.array([3.0, -4.0]), np.array([1.0, 2.0]), 0.0)
    np.testing.assert_allclose(out, [3 / np.sqrt(12.5), -8 / np.sqrt(12.5)])


def test_greedy_follows_argmax_and_rejects_bad_ids(tmp_path: Path, rng: np.random.Generator):
    m = tiny_model(tmp_path, rng, tied=False)
    prompt = rng.integers(0, CFG.vocab_size, 5).tolist()
    out = m.greedy(prompt, 6)
    assert out == [int(np.argmax(m.logits64(prompt + out[:i])[-1])) for i in range(6)]
    for bad in ([], [CFG.vocab_size], [-1]):
        with pytest.raises(ValueError):
            m.logits(bad)


def test_top1_margins_and_activation_rounding_deviation(tmp_path: Path, rng: np.random.Generator):
    """Prints the distributions oxibonsai's end-to-end tolerances are chosen from (run with -s)."""
    gaps, errors, flips = [], [], 0
    for tied in (True, False, True, False):
        m = tiny_model(tmp_path, rng, tied=tied)
        ids = rng.integers(0, CFG.vocab_size, 48)
        exact = m.logits64(ids)
        rounded = QuantizedActivationQwen3(m.hp, m.w).logits64(ids)
        top2 = np.sort(exact, axis=1)[:, -2:]
        gaps += list(top2[:, 1] - top2[:, 0])
        errors.append(np.abs(exact - rounded).max())
        flips += int(np.sum(exact.argmax(1) != rounded.argmax(1)))
    gaps_arr = np.array(gaps)
    levels = (1, 5, 10, 25, 50)
    pct = dict(zip(levels, np.percentile(gaps_arr, levels).round(3).tolist(), strict=True))
    print(f"top-1 gap percentiles {pct}; P(gap < 0.1) = {np.mean(gaps_arr < 0.1):.3f}")
    print(f"rounded-activation max |dlogit| per model {np.round(errors, 3)}, top-1 flips {flips}/{len(gaps)}")
    assert np.median(gaps_arr) > 0.3 and np.mean(gaps_arr < 0.05) < 0.15
    assert max(errors) < 1.0

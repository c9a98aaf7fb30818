"""The small ops of the torch path and the op-set choice: ``write_kv`` (ref and Triton) against a numpy
model of the slot rule, the Q1 ``embedding`` (Triton against ref, bit for bit), ``rms_norm`` (ref and
Triton) and ``rope_neox``/``silu_mul`` against the float64
numpy Qwen3 reference (``tests/qwen3_reference.py``), and ``dispatch.ops_for`` on this CPU machine.

Bounds: RMSNorm and SiLU are float32 elementwise work, ``ELEMENTWISE_TOL`` = 1e-5 relative. RoPE angles
are float64 ``position * inv_freq`` rounded to float32 cos and sin (as the native runner does), so the
rotation is float32 elementwise work at any position: ``ROPE_ATOL`` = 1e-5 for inputs of size about 1
(float32 angles, HF's and llama.cpp's, would need 2e-3 below position 4096). KV writes are exact,
including the cast to fp16."""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from oxibonsai.torch_backend.ops import ahead, dispatch, ref_torch  # noqa: E402

import qwen3_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the Triton kernels run
ELEMENTWISE_TOL = 1e-5
ROPE_ATOL = 1e-5
TRITON_MISSING = "triton is not installed (it comes with torch on Linux x86_64)"


def triton_module(name: str) -> ModuleType:
    """A Triton kernel module (interpreted here: conftest set TRITON_INTERPRET before this import)."""
    pytest.importorskip("triton", reason=TRITON_MISSING)
    return importlib.import_module(f"oxibonsai.torch_backend.ops.{name}")


def implementation(impl: str, triton_name: str) -> tuple[ModuleType, torch.device]:
    """``ref_torch`` on the CPU, or the Triton module ``triton_name`` on ``DEVICE``."""
    if impl == "ref":
        return ref_torch, torch.device("cpu")
    return triton_module(triton_name), DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_write_kv(rng: np.random.Generator, impl: str, dtype: torch.dtype) -> None:
    """Rows go to their slots (cast to the cache dtype), -1 rows nowhere, every other slot is untouched.
    k and v are head slices of one fused qkv tensor, so their row stride is not Hkv * D."""
    module, device = implementation(impl, "kv_triton")
    blocks, page, kv_heads, head_dim, tokens = 5, 16, 2, 32, 9
    qkv = torch.from_numpy(rng.standard_normal((tokens, 4 + 2 * kv_heads, head_dim)).astype(np.float32))
    k, v = qkv[:, 4 : 4 + kv_heads], qkv[:, 4 + kv_heads :]
    slots = rng.permutation(blocks * page)[:tokens]
    slots[rng.choice(tokens, size=3, replace=False)] = -1
    shape = (blocks, page, kv_heads, head_dim)
    k_cache = torch.from_numpy(rng.standard_normal(shape)).to(dtype)
    v_cache = torch.from_numpy(rng.standard_normal(shape)).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // page, slot % page] = k[row].to(dtype)
            expected_v[slot // page, slot % page] = v[row].to(dtype)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    module.write_kv(k.to(device), v.to(device), k_cache, v_cache, torch.from_numpy(slots).to(device))
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)


@pytest.mark.parametrize("shape", [(5, 96), (4, 3, 32)], ids=["hidden", "qk-norm"])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_rms_norm(rng: np.random.Generator, impl: str, shape: tuple[int, ...]) -> None:
    module, device = implementation(impl, "norm_triton")
    x = rng.standard_normal(shape) * 3
    weight = rng.standard_normal(shape[-1])
    x32, weight32 = (torch.from_numpy(a.astype(np.float32)).to(device) for a in (x, weight))
    out = module.rms_norm(x32, weight32, 1e-6).cpu()
    assert out.dtype == torch.float32 and tuple(out.shape) == shape
    expected = qwen3_reference.rms_norm(x, weight, 1e-6)
    np.testing.assert_allclose(out.numpy(), expected, rtol=ELEMENTWISE_TOL, atol=ELEMENTWISE_TOL)


@pytest.mark.parametrize("base", [10_000.0, 1_000_000.0])
def test_rope_neox(rng: np.random.Generator, base: float) -> None:
    tokens, heads, head_dim = 7, 3, 64
    x = rng.standard_normal((tokens, heads, head_dim))
    positions = rng.integers(0, 4096, size=tokens)
    out = ref_torch.rope_neox(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(positions), base)
    cos, sin = qwen3_reference.rope_tables(positions, head_dim, base)
    expected = qwen3_reference.rope_neox(x.transpose(1, 0, 2), cos, sin).transpose(1, 0, 2)  # heads first
    assert out.dtype == torch.float32 and tuple(out.shape) == x.shape
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=ROPE_ATOL)


def test_rope_neox_position_zero_is_identity(rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((3, 2, 16)).astype(np.float32))
    assert torch.equal(ref_torch.rope_neox(x, torch.zeros(3, dtype=torch.int64), 1e6), x)


def test_silu_mul(rng: np.random.Generator) -> None:
    gate, up = rng.standard_normal((2, 6, 40)) * 4
    out = ref_torch.silu_mul(
        torch.from_numpy(gate.astype(np.float32)), torch.from_numpy(up.astype(np.float32))
    )
    expected = qwen3_reference.silu(gate) * up
    np.testing.assert_allclose(out.numpy(), expected, rtol=ELEMENTWISE_TOL, atol=ELEMENTWISE_TOL)


def test_triton_embedding_gives_the_reference_rows_bit_for_bit(rng: np.random.Generator) -> None:
    """Random rows, repeats and the last row, including a zero scale (+-0 alike)."""
    import oxibonsai as ob
    from oxibonsai.torch_backend.ops.q1_weight import Q1Weight

    embed_triton = triton_module("embed_triton")
    rows, cols = 37, 384
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    values[5, :128] = 0.0  # a block whose scale is 0
    raw = np.frombuffer(ob.Q1Matrix.quantize(values).to_bytes(), dtype=np.uint8)
    ids = torch.from_numpy(np.concatenate([rng.integers(0, rows, 9), [5, rows - 1, 5]]).astype(np.int32))
    got = embed_triton.embedding(ids.to(DEVICE), Q1Weight.from_gguf(raw, rows, cols, DEVICE)).cpu()
    want = ref_torch.embedding(ids, Q1Weight.from_gguf(raw, rows, cols))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert embed_triton.embedding(ids[:0].to(DEVICE), Q1Weight.from_gguf(raw, rows, cols, DEVICE)).shape == (
        0,
        cols,
    )


def test_dispatch_picks_ref_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    ops = dispatch.ops_for(torch.device("cpu"))
    assert set(vars(ops)) == set(dispatch.OP_NAMES)
    assert all(getattr(ops, name) is getattr(ref_torch, name) for name in dispatch.OP_NAMES)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_dispatch_forced_triton(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Triton twins where they exist, the reference elsewhere; on the CPU only because the kernels are
    interpreted. (Building the namespace for "cuda" launches nothing, so it runs on this machine.)"""
    q1_exact, attn_triton = triton_module("q1_exact"), triton_module("attn_triton")
    kv_triton, norm_triton = triton_module("kv_triton"), triton_module("norm_triton")
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    monkeypatch.delenv(dispatch.Q1_ENV_VAR, raising=False)
    ops = dispatch.ops_for(device)
    assert set(vars(ops)) == set(dispatch.OP_NAMES) | set(ahead.OPS) | {"rope_kv"} and ahead.supported(ops)
    assert ops.rope_kv is attn_triton.RopeKv  # its attention takes the QKV rows
    assert ops.q1_fused_linear_ahead is q1_exact.fused_linear_ahead
    assert ops.attention_linear_ahead is attn_triton.attention_linear_ahead
    assert ops.q1_linear is q1_exact.q1_linear and ops.paged_attention is attn_triton.paged_attention
    assert ops.write_kv is kv_triton.write_kv and ops.rms_norm is norm_triton.rms_norm
    assert ops.embedding is triton_module("embed_triton").embedding and ops.rope_neox is ref_torch.rope_neox
    assert ops.silu_mul is ref_torch.silu_mul
    assert ops.attention_linear is attn_triton.attention_linear


def test_dispatch_defaults_to_triton_on_cuda_and_honours_ref(monkeypatch: pytest.MonkeyPatch) -> None:
    q1_exact = triton_module("q1_exact")
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv(dispatch.Q1_ENV_VAR, raising=False)
    assert dispatch.ops_for("cuda").q1_linear is q1_exact.q1_linear
    monkeypatch.setenv(dispatch.ENV_VAR, "ref")
    assert dispatch.ops_for("cuda").q1_linear is ref_torch.q1_linear


def test_dispatch_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    triton_module("q1_triton")
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda-please")
    with pytest.raises(ValueError, match=dispatch.ENV_VAR):
        dispatch.ops_for("cpu")
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    monkeypatch.setattr(dispatch, "_kernels_interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.ops_for("cpu")
    monkeypatch.setattr(dispatch, "_triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):
        dispatch.ops_for("cuda")

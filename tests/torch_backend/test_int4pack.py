"""The int4-pack Q1 linear (``ops/q1_int4pack``): Q1_0 repacked into torch's groupwise int4 format.

Every test runs on the CPU, through the CPU twin of the op (the same packing and nibble values), and on
MPS where there is an Apple GPU (``gpu`` marker). The packed weight dequantizes bit for bit to the Rust
dequantization (read back through a product with the identity, which adds only zeros). Products are
checked against float64 ``x @ W.T`` as ``max|y - oracle| / max|oracle|`` < ``FP32_TOL`` (measured
2e-7..1e-6 on the CPU; the reference op 1e-7..6e-7). A whole model on these ops must give the logits of
the same model on the reference ops within ``MODEL_TOL`` of the largest logit (measured 1.1e-6..1.3e-6)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

import oxibonsai as ob  # noqa: E402
from oxibonsai.torch_backend.batch import StepBatch  # noqa: E402
from oxibonsai.torch_backend.model import TorchQwen3  # noqa: E402
from oxibonsai.torch_backend.ops import q1_int4pack, ref_torch  # noqa: E402
from oxibonsai.torch_backend.ops.dispatch import OP_NAMES  # noqa: E402
from oxibonsai.torch_backend.ops.q1_int4pack import Int4Packed, ops_int4pack, pack, packed_for, q1_linear  # noqa: E402
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight  # noqa: E402

FP32_TOL = 1e-5
MODEL_TOL = 1e-4
M_VALUES = (1, 2, 15, 16, 17)
K_VALUES = (128, 256, 384)
N_VALUES = (40, 72, 256)  # 40 and 72 are multiples of 8 but not of the CPU twin's 16: padded rows

NO_MPS = "needs an Apple Silicon Mac (MPS)"
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not q1_int4pack.ops_available("cpu"),
            reason="this torch lacks _convert_weight_to_int4pack_for_cpu / _weight_int4pack_mm_for_cpu",
        ),
    ),
    pytest.param(
        "mps",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.backends.mps.is_available(), reason=NO_MPS)],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def random_q1(rng: np.random.Generator, rows: int, cols: int, device: str) -> tuple[Q1Weight, np.ndarray]:
    """(a Q1Weight on ``device``, the Rust dequantization float32 [rows, cols]) of random weights."""
    matrix = ob.Q1Matrix.quantize(rng.standard_normal((rows, cols)).astype(np.float32))
    raw = np.frombuffer(matrix.to_bytes(), dtype=np.uint8)
    return Q1Weight.from_gguf(raw, rows, cols, device), matrix.dequantize()


def rel_err(y: torch.Tensor, expected: np.ndarray) -> float:
    assert y.dtype == torch.float32 and tuple(y.shape) == expected.shape
    return float(np.abs(y.cpu().numpy() - expected).max() / np.abs(expected).max())


def test_the_packed_weight_dequantizes_to_the_rust_values(device, rng):
    rows, cols = 136, 384  # padded to 144 rows: three 64-row slices when packed slice by slice
    w, expected = random_q1(rng, rows, cols, device)
    p = pack(w)
    assert (p.rows, p.cols, p.padded_rows, p.device.type) == (rows, cols, 144, device)
    assert p.scales_and_zeros.dtype == torch.float32 and p.scales_and_zeros.shape == (cols // 128, 144, 2)
    assert p.nbytes == 144 * cols // 2 + 144 * cols // 128 * 8  # 4.5 bits a weight, 4x Q1_0's 1.125
    identity = torch.eye(cols, dtype=torch.float32, device=device)
    assert np.array_equal(q1_linear(identity, w).cpu().numpy().T, expected)
    sliced = pack(w, chunk_weights=1)  # the smallest slices: 64 rows, then the 16-row tail
    assert torch.equal(sliced.packed, p.packed) and torch.equal(sliced.scales_and_zeros, p.scales_and_zeros)


@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("n", N_VALUES)
def test_q1_linear_matches_the_float64_oracle_and_the_reference_op(device, rng, k, n):
    w, dense = random_q1(rng, n, k, device)
    for m in M_VALUES:
        x = rng.standard_normal((m, k)).astype(np.float32)
        xt = torch.from_numpy(x).to(device)
        y = q1_linear(xt, w)
        assert rel_err(y, x.astype(np.float64) @ dense.astype(np.float64).T) < FP32_TOL
        assert rel_err(y, ref_torch.q1_linear(xt, w).cpu().numpy()) < FP32_TOL


def test_half_precision_and_batched_activations_are_computed_in_float32(device, rng):
    w, _ = random_q1(rng, 48, 256, device)
    x = torch.from_numpy(rng.standard_normal((2, 3, 256)).astype(np.float32)).to(device)
    y = q1_linear(x, w)
    assert y.shape == (2, 3, 48) and y.is_contiguous()
    assert torch.equal(y, q1_linear(x.reshape(6, 256), w).reshape(2, 3, 48))
    half = x.to(torch.float16)
    assert torch.equal(q1_linear(half, w), q1_linear(half.float(), w))
    assert q1_linear(x[:0, 0], w).shape == (0, 48)


def test_the_packed_form_is_built_once_per_weight_object_and_dropped_with_it(rng):
    w, _ = random_q1(rng, 32, 128, "cpu")
    first = packed_for(w)
    assert isinstance(first, Int4Packed) and packed_for(w) is first
    twin = Q1Weight(signs=w.signs, scales=w.scales, rows=w.rows, cols=w.cols)  # equal, not identical
    assert packed_for(twin) is not first
    key = id(w)
    del w, first
    gc.collect()
    assert key not in q1_int4pack._CACHE


def test_bad_inputs_are_refused_with_a_clear_error(rng):
    w, _ = random_q1(rng, 16, 256, "cpu")
    with pytest.raises(ValueError, match="x has 128 columns, the 16x256 Q1 matrix needs 256"):
        q1_linear(torch.zeros(1, 128), w)
    on_meta = Q1Weight(signs=w.signs.to("meta"), scales=w.scales.to("meta"), rows=16, cols=256)
    with pytest.raises(ValueError, match="runs on cpu or mps .* none for 'meta'"):
        pack(on_meta)


def test_the_op_set_is_the_reference_set_with_this_q1_linear(rng):
    ops = ops_int4pack()
    assert sorted(vars(ops)) == sorted(OP_NAMES)
    assert ops.q1_linear is q1_linear
    own = ("q1_linear", "q1_fused_linear", "attention_linear")
    assert all(getattr(ops, name) is getattr(ref_torch, name) for name in OP_NAMES if name not in own)
    w, _ = random_q1(rng, 32, 128, "cpu")
    x, norm = torch.randn(3, 128), 1 + 0.1 * torch.randn(128)
    fused = ops.q1_fused_linear(x, w, norm=norm, eps=1e-6, gated=True)
    torch.testing.assert_close(
        fused, ref_torch.silu_mul(*q1_linear(ref_torch.rms_norm(x, norm, 1e-6), w).chunk(2, 1))
    )


def test_a_model_on_the_int4pack_ops_gives_the_reference_logits(device, tiny_model: Path, rng):
    reference = TorchQwen3.from_gguf(tiny_model, "cpu", ref_torch)
    model = TorchQwen3.from_gguf(tiny_model, device, ops=ops_int4pack())
    ids = [int(t) for t in rng.integers(0, model.config.vocab, 24)]

    def logits(m: TorchQwen3, where: str) -> np.ndarray:
        """A 23-token prefill, then one decode token (a batch of one row)."""
        kv = m.new_kv_pool(3)
        steps = [([2, 0], 0, ids[:23], True), ([2, 0], 23, ids[23:], True)]
        out = [m.forward(StepBatch.for_sequences([s]).to_device(where), kv).cpu().numpy() for s in steps]
        return np.concatenate(out)

    expected = logits(reference, "cpu")
    ours = logits(model, device)
    assert ours.shape == (24, model.config.vocab)
    assert np.abs(ours - expected).max() / np.abs(expected).max() < MODEL_TOL

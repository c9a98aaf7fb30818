"""The f16x2 Q1 GEMV (``ops/q1_fast``): its plain-Triton twin (``asm=False``, in the interpreter here)
against float64, across activation scales from 1e-2 to 1e3 (the per-group scaling keeps every fp16
value in [-1, 1]), row counts, the folded norm, gate|up, residual and split K; the op set's
``fused_linear`` off CUDA is exactly ``q1_triton``'s. Where CUDA exists the PTX must equal the twin
bit for bit.

Bound: ``FAST_TOL`` = 4e-3 of the largest output (fp16 activations and 16-term fp16 sums; measured
at most 1.8e-3 over 30 random cases)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")
pytest.importorskip("triton", reason="triton is not installed")

import oxibonsai as ob  # noqa: E402
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight  # noqa: E402

from q1_reference import fused_linear as reference_fused_linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FAST_TOL = 4e-3
EPS = 1e-6


def q1_fast():
    from oxibonsai.torch_backend.ops import q1_fast

    return q1_fast


def random_case(rng: np.random.Generator, m: int, rows: int, k: int):
    matrix = ob.Q1Matrix.quantize(rng.standard_normal((rows, k)).astype(np.float32))
    w = Q1Weight.from_gguf(np.frombuffer(matrix.to_bytes(), dtype=np.uint8), rows, k, DEVICE)
    scale = float(rng.choice([0.01, 1.0, 1000.0]))
    x = rng.standard_normal((m, k)).astype(np.float32) * scale
    return w, matrix.dequantize().astype(np.float64), x


def on_device(a):
    return None if a is None else torch.from_numpy(a).to(DEVICE)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("m", [1, 2])
def test_the_twin_matches_float64_within_fp16_rounding(rng, m):
    for _ in range(4):
        rows, k = int(rng.choice([40, 64, 96])), int(rng.choice([128, 256, 512]))
        w, w64, x = random_case(rng, m, rows, k)
        gated, normed = bool(rng.integers(2)), bool(rng.integers(2))
        norm = (1 + 0.2 * rng.standard_normal(k)).astype(np.float32) if normed else None
        out_rows = rows // 2 if gated else rows
        residual = rng.standard_normal((m, out_rows)).astype(np.float32) if rng.random() < 0.5 else None
        got = q1_fast().q1_gemv_fast(
            on_device(x), w, norm=on_device(norm), eps=EPS, residual=on_device(residual), gated=gated,
            asm=False, split_k=int(rng.integers(1, 4)),
        )  # fmt: skip
        want = reference_fused_linear(x, w64, norm, residual, gated, EPS)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert np.abs(got.cpu().numpy() - want).max() <= FAST_TOL * np.abs(want).max()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice off CUDA")
def test_off_cuda_the_op_is_the_plain_fused_linear(rng):
    from oxibonsai.torch_backend.ops import q1_triton

    w, _, x = random_case(rng, 1, 64, 256)
    norm = torch.rand(256) + 0.5
    got = q1_fast().fused_linear(torch.from_numpy(x), w, norm=norm, eps=EPS, gated=True)
    assert torch.equal(got, q1_triton.q1_fused_linear(torch.from_numpy(x), w, norm=norm, eps=EPS, gated=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the PTX runs on CUDA only")
def test_the_ptx_equals_its_twin_bit_for_bit(rng):
    assert q1_fast().asm_matches_twin(torch.cuda.current_device())
    w, w64, x = random_case(rng, 1, 4096, 2048)
    got = q1_fast().q1_gemv_fast(on_device(x), w, asm=True)
    assert torch.equal(got, q1_fast().q1_gemv_fast(on_device(x), w, asm=False))
    want = reference_fused_linear(x, w64, None, None, False, EPS)
    assert np.abs(got.cpu().numpy() - want).max() <= FAST_TOL * np.abs(want).max()

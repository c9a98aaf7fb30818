"""Q1_0 weights and linear layers of the torch path (``ops/q1_weight``, ``ref_torch``, ``q1_triton``).

The packed layout is checked byte-exact against the Rust dequantization and the independent numpy one
(``tests/q1_reference.py``). The linears are checked against float64 ``x @ W.T`` over the
Rust-dequantized W, as ``max|y - oracle| / max|oracle|``: ``FP32_TOL`` for float32 paths (ref, the
GEMV and the "ieee" GEMM; measured 1e-7..5e-7), ``DOT_TOL`` for the GEMM's "tf32" (the default) and
"fp16" dots (measured 2e-4 for fp16; the interpreter computes tf32 exactly, a GPU rounds it like fp16).
Triton runs in its interpreter here, so shapes are tiny."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

import oxibonsai as ob  # noqa: E402
from oxibonsai.torch_backend.ops import ref_torch  # noqa: E402
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight  # noqa: E402

from q1_reference import dequantize  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the Triton kernels run
FP32_TOL = 1e-5
DOT_TOL = 2e-3
M_VALUES = (1, 2, 15, 16, 17)
K_VALUES = (128, 256, 384)
N_VALUES = (40, 72)  # neither a multiple of the GEMV's 32 nor the GEMM's 64


@pytest.fixture
def q1_triton() -> ModuleType:
    """The Triton kernels' module (interpreted here: conftest set TRITON_INTERPRET before this import)."""
    pytest.importorskip("triton", reason="triton is not installed (it comes with torch on Linux x86_64)")
    from oxibonsai.torch_backend.ops import q1_triton

    return q1_triton


def random_q1(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(GGUF Q1_0 bytes as a read-only uint8 array, the Rust dequantization float32 [rows, cols])."""
    matrix = ob.Q1Matrix.quantize(rng.standard_normal((rows, cols)).astype(np.float32))
    return np.frombuffer(matrix.to_bytes(), dtype=np.uint8), matrix.dequantize()


def oracle(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64).T


def rel_err(y: torch.Tensor, expected: np.ndarray) -> float:
    assert y.dtype == torch.float32 and tuple(y.shape) == expected.shape
    return float(np.abs(y.cpu().numpy() - expected).max() / np.abs(expected).max())


def test_from_gguf_matches_rust_dequantization(rng: np.random.Generator) -> None:
    rows, cols = 5, 384
    raw, w = random_q1(rng, rows, cols)
    packed = Q1Weight.from_gguf(raw.reshape(rows, -1), rows, cols)  # a 2-D read-only view, as GGUF gives
    assert packed.signs.dtype == torch.int32 and packed.signs.shape == (rows, cols // 32)
    assert packed.scales.dtype == torch.float16 and packed.scales.shape == (rows, cols // 128)
    assert packed.nbytes == raw.size
    assert np.array_equal(packed.dequantize().numpy(), w)
    assert np.array_equal(w, dequantize(raw.tobytes(), rows, cols))


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_rows_dequantized_and_embedding_are_rows(rng: np.random.Generator, id_dtype: torch.dtype) -> None:
    raw, w = random_q1(rng, 9, 256)
    packed = Q1Weight.from_gguf(raw, 9, 256)
    ids = rng.integers(0, 9, size=6)  # repeats allowed
    torch_ids = torch.from_numpy(ids).to(id_dtype)
    assert np.array_equal(packed.rows_dequantized(torch_ids).numpy(), w[ids])
    assert np.array_equal(ref_torch.embedding(torch_ids, packed).numpy(), w[ids])


@pytest.mark.parametrize(
    ("data", "rows", "cols"),
    [
        (np.zeros(2 * 18 - 1, dtype=np.uint8), 2, 128),  # one byte short
        (np.zeros(2 * 18 + 18, dtype=np.uint8), 2, 128),  # a block too many
        (np.zeros(18, dtype=np.uint8), 1, 64),  # cols not a multiple of 128
        (np.zeros(18, dtype=np.uint8), 0, 128),
        (np.zeros(18, dtype=np.float32), 1, 128),  # not bytes
    ],
)
def test_from_gguf_rejects_bad_sizes(data: np.ndarray, rows: int, cols: int) -> None:
    with pytest.raises(ValueError):
        Q1Weight.from_gguf(data, rows, cols)


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
def test_ref_q1_linear(rng: np.random.Generator, m: int, k: int, n: int) -> None:
    raw, w = random_q1(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = ref_torch.q1_linear(torch.from_numpy(x), Q1Weight.from_gguf(raw, n, k))
    assert rel_err(y, oracle(x, w)) < FP32_TOL


def test_ref_q1_linear_in_chunks(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ref_torch, "DEQUANT_CHUNK_FLOATS", 3 * 256)  # 3 rows a chunk; 40 rows -> 14 chunks
    raw, w = random_q1(rng, 40, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    y = ref_torch.q1_linear(torch.from_numpy(x), Q1Weight.from_gguf(raw, 40, 256))
    assert rel_err(y, oracle(x, w)) < FP32_TOL


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
def test_triton_q1_linear(q1_triton: ModuleType, rng: np.random.Generator, m: int, k: int, n: int) -> None:
    """The default pick: the GEMV (float32) up to 8 rows, the tf32 GEMM above."""
    raw, w = random_q1(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = q1_triton.q1_linear(torch.from_numpy(x).to(DEVICE), Q1Weight.from_gguf(raw, n, k, DEVICE))
    assert rel_err(y, oracle(x, w)) < (FP32_TOL if m <= q1_triton.GEMV_MAX_M else DOT_TOL)


@pytest.mark.parametrize(("m", "split_k", "block_n"), [(3, 2, 16), (8, 3, 32), (5, 1, 64)])
def test_triton_gemv_rows_and_split_k(
    q1_triton: ModuleType, rng: np.random.Generator, m: int, split_k: int, block_n: int
) -> None:
    raw, w = random_q1(rng, 72, 384)
    x = rng.standard_normal((m, 384)).astype(np.float32)
    y = q1_triton.q1_gemv(
        torch.from_numpy(x).to(DEVICE), Q1Weight.from_gguf(raw, 72, 384, DEVICE), block_n, split_k
    )
    assert rel_err(y, oracle(x, w)) < FP32_TOL


@pytest.mark.parametrize(("precision", "tol"), [("ieee", FP32_TOL), ("tf32", DOT_TOL), ("fp16", DOT_TOL)])
def test_triton_gemm_precisions(
    q1_triton: ModuleType, rng: np.random.Generator, precision: str, tol: float
) -> None:
    raw, w = random_q1(rng, 72, 256)
    x = rng.standard_normal((33, 256)).astype(np.float32)  # three 16-row tiles, the last one ragged
    y = q1_triton.q1_gemm(
        torch.from_numpy(x).to(DEVICE),
        Q1Weight.from_gguf(raw, 72, 256, DEVICE),
        block_m=16,
        precision=precision,
    )
    assert rel_err(y, oracle(x, w)) < tol


@pytest.mark.parametrize("m", [2, 17])
def test_triton_q1_linear_strided_rows(q1_triton: ModuleType, rng: np.random.Generator, m: int) -> None:
    """x as a column slice of a wider activation (row stride != K), as a fused projection gives."""
    raw, w = random_q1(rng, 40, 128)
    wide = rng.standard_normal((m, 384)).astype(np.float32)
    y = q1_triton.q1_linear(
        torch.from_numpy(wide).to(DEVICE)[:, 128:256], Q1Weight.from_gguf(raw, 40, 128, DEVICE)
    )
    assert rel_err(y, oracle(wide[:, 128:256], w)) < DOT_TOL


@pytest.mark.parametrize("linear", ["q1_gemv", "q1_gemm"])
def test_triton_q1_linear_rejects_wrong_width(
    q1_triton: ModuleType, rng: np.random.Generator, linear: str
) -> None:
    raw, _ = random_q1(rng, 8, 256)
    with pytest.raises(ValueError):
        getattr(q1_triton, linear)(
            torch.zeros(2, 128, device=DEVICE), Q1Weight.from_gguf(raw, 8, 256, DEVICE)
        )


def fused_oracle(
    x: np.ndarray, w: np.ndarray, norm: np.ndarray | None, residual: np.ndarray | None, gated: bool
) -> np.ndarray:
    """float64 ``residual + silu(gate) * up`` (or ``+ y``) of ``rms_norm(x) @ W.T``."""
    x64 = x.astype(np.float64)
    if norm is not None:
        x64 = x64 / np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + EPS) * norm
    y = x64 @ w.astype(np.float64).T
    if gated:
        gate, up = np.split(y, 2, axis=1)
        y = gate / (1 + np.exp(-gate)) * up
    return y if residual is None else y + residual


EPS = 1e-6
FUSED_CASES = [  # (m, rows, k, split_k, norm, residual, gated)
    (1, 72, 384, 1, True, False, False),
    (3, 80, 384, 3, True, False, True),
    (8, 40, 256, 2, False, True, False),
    (5, 72, 384, 1, False, True, False),
    (2, 144, 256, None, True, True, True),
    (6, 96, 512, 4, False, False, True),
]


# The interpreter's numpy sigmoid overflows exp(-gate) for gates below -88: silu is then exactly -0.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(("m", "rows", "k", "split_k", "normed", "with_residual", "gated"), FUSED_CASES)
def test_fused_gemv_is_norm_matmul_silu_and_residual(
    q1_triton: ModuleType,
    rng: np.random.Generator,
    m: int,
    rows: int,
    k: int,
    split_k: int | None,
    normed: bool,
    with_residual: bool,
    gated: bool,
) -> None:
    """The GEMV's folded RMSNorm prologue and SiLU-multiply / residual epilogues, split or not, and the
    plain-torch twin, against float64."""
    raw, w = random_q1(rng, rows, k)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    norm = (1 + 0.2 * rng.standard_normal(k)).astype(np.float32) if normed else None
    out_rows = rows // 2 if gated else rows
    residual = rng.standard_normal((m, out_rows)).astype(np.float32) if with_residual else None
    expected = fused_oracle(x, w, norm, residual, gated)

    def tensor(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(a).to(DEVICE)

    args = {"norm": tensor(norm), "eps": EPS, "residual": tensor(residual), "gated": gated}
    weight = Q1Weight.from_gguf(raw, rows, k, DEVICE)
    ours = q1_triton.q1_gemv_fused(tensor(x), weight, split_k=split_k, **args)
    assert rel_err(ours, expected) < FP32_TOL
    assert rel_err(q1_triton.q1_fused_linear(tensor(x), weight, **args), expected) < FP32_TOL
    ref = ref_torch.q1_fused_linear(torch.from_numpy(x), Q1Weight.from_gguf(raw, rows, k), **args_cpu(args))
    assert rel_err(ref, expected) < FP32_TOL


def args_cpu(args: dict[str, object]) -> dict[str, object]:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def test_fused_linear_above_the_gemv_rows_runs_the_gemm(
    q1_triton: ModuleType, rng: np.random.Generator
) -> None:
    raw, w = random_q1(rng, 80, 256)
    x = rng.standard_normal((11, 256)).astype(np.float32)
    norm = (1 + 0.2 * rng.standard_normal(256)).astype(np.float32)
    residual = rng.standard_normal((11, 40)).astype(np.float32)
    y = q1_triton.q1_fused_linear(
        torch.from_numpy(x).to(DEVICE),
        Q1Weight.from_gguf(raw, 80, 256, DEVICE),
        norm=torch.from_numpy(norm).to(DEVICE),
        eps=EPS,
        residual=torch.from_numpy(residual).to(DEVICE),
        gated=True,
    )
    assert rel_err(y, fused_oracle(x, w, norm, residual, True)) < DOT_TOL


def test_fused_gemv_rejects_mismatched_operands(q1_triton: ModuleType, rng: np.random.Generator) -> None:
    raw, _ = random_q1(rng, 9, 128)
    weight = Q1Weight.from_gguf(raw, 9, 128, DEVICE)
    x = torch.zeros(2, 128, device=DEVICE)
    with pytest.raises(ValueError, match="even number of rows"):
        q1_triton.q1_gemv_fused(x, weight, gated=True)
    with pytest.raises(ValueError, match="norm weight"):
        q1_triton.q1_gemv_fused(x, weight, norm=torch.ones(64, device=DEVICE))
    with pytest.raises(ValueError, match="residual"):
        q1_triton.q1_gemv_fused(x, weight, residual=torch.zeros(2, 8, device=DEVICE))

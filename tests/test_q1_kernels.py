"""Every matmul kernel on every instruction set this CPU has, against float64 references."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from oxibonsai import Q1Matrix, get_num_threads, kernel_info, set_num_threads
from oxibonsai._core import quantize_activations

import q1_reference as ref

ISAS = kernel_info()["available"]
QUANTIZED_KERNELS = ["lut", "gemm", "lut-gemm", "vnni-gemm", "perm-gemm", "amx-gemm", "signflip", "auto"]
ROWS = [1, 33, 4097]
COLS = [128, 4224]
NS = [1, 3, 17, 64]


def activations(rng: np.random.Generator, n: int, cols: int) -> np.ndarray:
    """Standard normal with a few large outliers (0.1% of values scaled by 20)."""
    x = rng.standard_normal((n, cols)).astype(np.float32)
    outliers = rng.random((n, cols)) < 0.001
    x[outliers] *= 20
    return x


def random_matrix(rng: np.random.Generator, rows: int, cols: int) -> tuple[Q1Matrix, bytes]:
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 1.0, (rows, 1)).astype(
        np.float32
    )
    m = Q1Matrix.quantize(w)
    return m, m.to_bytes()


def rel_err(y: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(y - exact) / np.linalg.norm(exact))


def accumulation_err(y: np.ndarray, buf: bytes, rows: int, cols: int, q: np.ndarray, s: np.ndarray) -> float:
    """The largest error relative to what the f32 sum over blocks works against: the sum of the blocks'
    magnitudes. Unlike ``rel_err`` it stays meaningful when an output cancels to near zero (one row,
    one activation row: a single value that happens to be small)."""
    d, _ = ref.unpack(buf, rows, cols)
    q_abs = np.abs(q.astype(np.float64)).reshape(q.shape[0], cols // ref.QK, ref.QK).sum(axis=2)
    magnitude = (q_abs * s.astype(np.float64)) @ np.abs(d.astype(np.float64)).T
    exact = ref.exact_quantized(buf, rows, cols, q, s)
    return float(np.max(np.abs(y - exact) / np.maximum(magnitude, np.finfo(np.float64).tiny)))


def massive_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Normal rows with four channels 30, 100 or 1000 times larger (massive activations)."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    channels = rng.choice(k, size=4, replace=False)
    x[:, channels] *= np.float32(rng.choice([30.0, 100.0, 1000.0]))
    return x


@pytest.mark.parametrize("isa", ISAS)
def test_activation_quantization_matches_reference(rng: np.random.Generator, isa: str) -> None:
    """The core's int16 rule gives the numpy rule's bits on every ISA, with every block's sum of |q|
    within the bound, on plain rows (one block zero, one below 2^-96) and rows with massive values."""
    plain = activations(rng, 5, 1024)
    plain[0, :128] = 0.0
    plain[1, :128] *= np.float32(1e-32)
    for x in (plain, massive_rows(rng, 3, 384), massive_rows(rng, 5, 2048)):
        q, s = quantize_activations(x, isa=isa)
        q_ref, s_ref = ref.quantize_activations(x)
        assert q.dtype == np.int16
        np.testing.assert_array_equal(q, q_ref)
        np.testing.assert_array_equal(s, s_ref)
        l1 = np.abs(q.astype(np.int64)).reshape(x.shape[0], -1, ref.QK).sum(axis=2)
        assert l1.max() <= ref.L1_MAX
    _, s = quantize_activations(plain, isa=isa)
    assert s[0, 0] == 0.0 and s[1, 0] == 0.0 and s[2, 0] > 0.0


def test_activation_quantization_is_far_more_exact_than_int8(rng: np.random.Generator) -> None:
    x = massive_rows(rng, 4, 1024)
    err16 = np.linalg.norm(ref.dequantized(*quantize_activations(x)) - x)
    err8 = np.linalg.norm(ref.dequantized(*ref.quantize_activations_int8(x)) - x)
    # Blocks without a massive value gain ~7x (scale ~ L1/32575 against amax/127 for normal values),
    # blocks with one far more; a flat block would gain only 2x, which normal rows never are.
    assert err16 < err8 / 5, (err16, err8)


@pytest.mark.parametrize(("rows", "cols"), list(itertools.product(ROWS, COLS)))
def test_quantized_kernels_match_float64_reference_and_each_other(
    rng: np.random.Generator, rows: int, cols: int
) -> None:
    m, buf = random_matrix(rng, rows, cols)
    for n in NS:
        x = activations(rng, n, cols)
        q, s = ref.quantize_activations(x)
        exact = ref.exact_quantized(buf, rows, cols, q, s)
        first = None
        for isa, kernel in itertools.product(ISAS, QUANTIZED_KERNELS):
            if isa == "scalar" and rows * cols * n > 50_000_000:
                continue  # the portable loops are slow; smaller shapes cover them
            y = m.matmul(x, kernel=kernel, isa=isa)
            assert y.shape == (n, rows) and y.dtype == np.float32
            assert accumulation_err(y, buf, rows, cols, q, s) < 1e-6, (isa, kernel, n)
            if rows * n >= 16:  # enough outputs that their norm cannot cancel to near zero
                assert rel_err(y, exact) < 1e-5, (isa, kernel, n)
            if first is None:
                first = y
            # Every kernel sums each block exactly and scales it with the same fma: bit-identical.
            np.testing.assert_array_equal(y, first, err_msg=f"{isa}/{kernel} n={n}")


def test_gemm_matches_the_lut_gemms_bit_for_bit_on_random_shapes(rng: np.random.Generator) -> None:
    """The small GEMMs (6-bit lookup on AVX-512, VNNI and AMX where the CPU has them) for 2..70
    activation rows."""
    for _ in range(6):
        rows, cols, n = int(rng.integers(1, 200)), 128 * int(rng.integers(1, 9)), int(rng.integers(2, 71))
        m, buf = random_matrix(rng, rows, cols)
        x = activations(rng, n, cols)
        q, s = ref.quantize_activations(x)
        want = m.matmul(x, kernel="lut-gemm", isa="scalar")
        assert rel_err(want, ref.exact_quantized(buf, rows, cols, q, s)) < 1e-5
        for isa, kernel in itertools.product(
            ISAS, ["gemm", "lut-gemm", "vnni-gemm", "perm-gemm", "amx-gemm", "auto"]
        ):
            np.testing.assert_array_equal(
                m.matmul(x, kernel=kernel, isa=isa), want, err_msg=f"{isa}/{kernel} n={n}"
            )


@pytest.mark.parametrize("kernel", ["reference", *QUANTIZED_KERNELS])
def test_kernels_match_float32_activations(rng: np.random.Generator, kernel: str) -> None:
    rows, cols = 300, 2048
    m, buf = random_matrix(rng, rows, cols)
    x = activations(rng, 4, cols)
    exact = x.astype(np.float64) @ ref.dequantize(buf, rows, cols).astype(np.float64).T
    for isa in ISAS:
        y = m.matmul(x, kernel=kernel, isa=isa)
        nmse = float(np.sum((y - exact) ** 2) / np.sum(exact**2))
        limit = 1e-10 if kernel == "reference" else 5e-4
        assert nmse <= limit, (isa, nmse)


def test_vector_input_gives_vector_output(rng: np.random.Generator) -> None:
    m, _ = random_matrix(rng, 70, 256)
    x = activations(rng, 1, 256)
    y = m.matmul(x[0])
    assert y.shape == (70,)
    np.testing.assert_array_equal(y, m.matmul(x)[0])


def test_zero_rows_of_activations(rng: np.random.Generator) -> None:
    m, _ = random_matrix(rng, 10, 128)
    assert m.matmul(np.zeros((0, 128), np.float32)).shape == (0, 10)


@pytest.mark.parametrize("kernel", ["reference", *QUANTIZED_KERNELS])
def test_results_are_bit_identical_for_1_2_and_4_threads(rng: np.random.Generator, kernel: str) -> None:
    m, _ = random_matrix(rng, 1000, 1152)
    x = activations(rng, 17, 1152)
    before = get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 4):
            set_num_threads(threads)
            assert get_num_threads() == threads
            outs.append(m.matmul(x, kernel=kernel))
    finally:
        set_num_threads(before)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_kernel_info_names_the_active_path() -> None:
    info = kernel_info()
    requested = os.environ.get("OXIBONSAI_ISA")
    # The fastest set, unless OXIBONSAI_ISA names another one this CPU has.
    want = requested if requested in info["available"] else info["available"][-1]
    assert info["isa"] == want
    assert info["available"][0] == "scalar"
    assert info["gemv"].startswith("lut-")
    assert info["gemm"] == "amx-gemm" or info["gemm"].startswith(("lut-gemm-", "perm-gemm-"))
    assert (info["gemm"] in ("perm-gemm-avx512", "amx-gemm")) == (info["isa"] == "avx512")
    assert info["num_threads"] == get_num_threads() >= 1

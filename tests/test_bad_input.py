"""Bad input gets a clear TypeError/ValueError naming what was expected and what was given."""

from __future__ import annotations

import numpy as np
import pytest

from oxibonsai import Q1Matrix, set_num_threads

KERNELS = ("auto", "lut", "gemm", "lut-gemm", "vnni-gemm", "perm-gemm", "amx-gemm", "signflip", "reference")


@pytest.fixture
def matrix(rng: np.random.Generator) -> Q1Matrix:
    return Q1Matrix.quantize(rng.standard_normal((8, 256)).astype(np.float32))


def test_quantize_rejects_wrong_dtype_shape_and_values(rng: np.random.Generator) -> None:
    w = rng.standard_normal((4, 256))
    with pytest.raises(TypeError, match="float32, got float64"):
        Q1Matrix.quantize(w)
    with pytest.raises(TypeError, match="numpy.ndarray of float32, got list"):
        Q1Matrix.quantize([[1.0] * 128])
    with pytest.raises(ValueError, match="must be 2-D, got a 1-D"):
        Q1Matrix.quantize(w[0].astype(np.float32))
    with pytest.raises(ValueError, match="multiple of 128.*got 200"):
        Q1Matrix.quantize(np.ones((2, 200), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        Q1Matrix.quantize(np.ones((256, 4), np.float32).T)
    for bad in (np.nan, np.inf, -np.inf):
        w32 = w.astype(np.float32)
        w32[2, 130] = bad
        with pytest.raises(ValueError, match=r"finite.*\(2, 130\)"):
            Q1Matrix.quantize(w32)


def test_from_bytes_rejects_wrong_length_type_and_bad_scales(matrix: Q1Matrix) -> None:
    buf = matrix.to_bytes()
    with pytest.raises(ValueError, match=f"is {len(buf)} bytes, got {len(buf) - 1}"):
        Q1Matrix.from_bytes(buf[:-1], 8, 256)
    with pytest.raises(ValueError, match="multiple of 128"):
        Q1Matrix.from_bytes(buf, 16, 129)
    with pytest.raises(ValueError, match="positive"):
        Q1Matrix.from_bytes(buf, 0, 256)
    with pytest.raises(TypeError, match="bytes-like"):
        Q1Matrix.from_bytes("not bytes", 8, 256)
    with pytest.raises(TypeError, match="bytes-like"):
        Q1Matrix.from_bytes(np.zeros(len(buf) // 4, np.float32), 8, 256)
    for bad_scale in (b"\x00\x7c", b"\x00\xfe"):  # fp16 +inf, NaN
        corrupt = bytearray(buf)
        corrupt[18 * 3 : 18 * 3 + 2] = bad_scale
        with pytest.raises(ValueError, match="block 1 of row 1 has a non-finite fp16 scale"):
            Q1Matrix.from_bytes(bytes(corrupt), 8, 256)


def test_matmul_rejects_bad_activations(matrix: Q1Matrix, rng: np.random.Generator) -> None:
    with pytest.raises(TypeError, match="float32, got float64"):
        matrix.matmul(rng.standard_normal(256))
    with pytest.raises(TypeError, match="float32, got int64"):
        matrix.matmul(np.ones(256, np.int64))
    with pytest.raises(ValueError, match="x has 128 columns but the matrix has 256"):
        matrix.matmul(np.ones(128, np.float32))
    with pytest.raises(ValueError, match="1-D or 2-D, got a 3-D"):
        matrix.matmul(np.ones((1, 2, 256), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        matrix.matmul(np.ones((512, 2), np.float32)[::2].T)
    for kernel in KERNELS:
        x = rng.standard_normal((3, 256)).astype(np.float32)
        x[1, 7] = np.nan
        with pytest.raises(ValueError, match=r"finite.*\(1, 7\)"):
            matrix.matmul(x, kernel=kernel)


def test_unknown_kernel_isa_and_thread_count(matrix: Q1Matrix) -> None:
    x = np.ones(256, np.float32)
    with pytest.raises(ValueError, match='unknown kernel "fast"'):
        matrix.matmul(x, kernel="fast")
    with pytest.raises(ValueError, match='unknown instruction set "sse9"'):
        matrix.matmul(x, isa="sse9")
    missing = "neon" if "neon" not in __import__("oxibonsai").kernel_info()["available"] else "avx2"
    with pytest.raises(ValueError, match=f"does not support the {missing}"):
        matrix.matmul(x, isa=missing)
    with pytest.raises(ValueError, match=">= 1, got 0"):
        set_num_threads(0)

"""Q1_0 bytes: quantize, from_bytes/to_bytes, dequantize, against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from oxibonsai import Q1Matrix

import q1_reference as ref


def normal_with_outliers(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3.0)
    mask = rng.random(shape) < 0.01
    w[mask] *= 50
    return w


@pytest.mark.parametrize(("rows", "cols"), [(1, 128), (3, 256), (33, 4224), (64, 2048)])
def test_quantize_matches_reference_bytes(rng: np.random.Generator, rows: int, cols: int) -> None:
    w = normal_with_outliers(rng, (rows, cols))
    assert Q1Matrix.quantize(w).to_bytes() == ref.quantize(w)


def edge_blocks(rng: np.random.Generator) -> dict[str, np.ndarray]:
    normal = rng.standard_normal(128).astype(np.float32)
    zeros = np.zeros(128, np.float32)
    neg_zero = np.full(128, -0.0, np.float32)
    mixed_zero = np.where(rng.random(128) < 0.5, 0.0, -0.0).astype(np.float32)
    big_element = normal.copy()
    big_element[rng.integers(128)] = 1e6  # beyond fp16 range; the block mean still fits
    huge_but_fits = np.full(128, 65000.0, np.float32) * np.sign(normal)
    tiny = normal * np.float32(1e-7)  # mean below fp16's normal range: subnormal or zero scale
    return {
        "zeros": zeros,
        "negative zero": neg_zero,
        "mixed signed zeros": mixed_zero,
        "all negative": -np.abs(normal) - 0.1,
        "all positive": np.abs(normal),
        "one element beyond fp16": big_element,
        "mean near fp16 max": huge_but_fits,
        "subnormal scale": tiny,
    }


def test_quantize_edge_cases_match_reference(rng: np.random.Generator) -> None:
    for name, block in edge_blocks(rng).items():
        w = np.tile(block, (2, 1))
        assert Q1Matrix.quantize(w).to_bytes() == ref.quantize(w), name


def test_negative_zero_is_positive_and_zero_block_has_zero_scale() -> None:
    w = np.full((1, 128), -0.0, np.float32)
    raw = Q1Matrix.quantize(w).to_bytes()
    assert raw[:2] == b"\x00\x00"
    assert raw[2:] == b"\xff" * 16


def test_block_mean_beyond_fp16_is_an_error() -> None:
    w = np.full((2, 256), 7e4, np.float32)
    with pytest.raises(ValueError, match=r"block 0 of row 0 .*fp16"):
        Q1Matrix.quantize(w)


@pytest.mark.parametrize(("rows", "cols"), [(1, 128), (5, 384), (40, 1024)])
def test_from_bytes_round_trips_and_dequantizes_exactly(
    rng: np.random.Generator, rows: int, cols: int
) -> None:
    buf = ref.quantize(normal_with_outliers(rng, (rows, cols)))
    m = Q1Matrix.from_bytes(buf, rows, cols)
    assert m.to_bytes() == buf
    assert (m.rows, m.cols, m.shape, m.nbytes) == (rows, cols, (rows, cols), len(buf))
    np.testing.assert_array_equal(m.dequantize(), ref.dequantize(buf, rows, cols))


def test_from_random_bytes_round_trips(rng: np.random.Generator) -> None:
    rows, cols = 7, 512
    raw = rng.integers(0, 256, size=(rows * cols // 128, 18), dtype=np.uint8)
    scales = rng.standard_normal(rows * cols // 128).astype("<f2")
    raw[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    buf = raw.tobytes()
    for source in (buf, bytearray(buf), memoryview(buf), raw.reshape(-1)):
        assert Q1Matrix.from_bytes(source, rows, cols).to_bytes() == buf


def test_dequantize_of_quantize_has_block_mean_magnitude(rng: np.random.Generator) -> None:
    w = rng.standard_normal((4, 256)).astype(np.float32)
    dq = Q1Matrix.quantize(w).dequantize()
    assert dq.dtype == np.float32 and dq.shape == w.shape
    np.testing.assert_array_equal(np.sign(dq), np.where(w >= 0, 1.0, -1.0))
    means = np.abs(w).reshape(4, 2, 128).mean(axis=2)
    np.testing.assert_allclose(np.abs(dq).reshape(4, 2, 128)[:, :, 0], means, rtol=1e-3)

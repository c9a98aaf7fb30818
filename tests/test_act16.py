"""The int16 activation rule of issue 26 in the Rust core (``_core.quantize_activations_i16``) against
the numpy definition the study chose (``int16_l1_activations``): the same bits, every block's sum of
``|q|`` within int16 even with massive values, and far smaller error than the int8 kernels' rule."""

from __future__ import annotations

import numpy as np
from test_massive_activations import dequantized, int16_l1_activations

from oxibonsai import _core

from q1_reference import quantize_activations


def massive_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    x = rng.standard_normal((n, k)).astype(np.float32)
    channels = rng.choice(k, size=4, replace=False)
    x[:, channels] *= np.float32(rng.choice([30.0, 100.0, 1000.0]))
    return x


def test_the_core_gives_the_numpy_rules_bits(rng):
    for n, k in [(1, 128), (3, 384), (5, 2048)]:
        x = massive_rows(rng, n, k)
        q, scale = _core.quantize_activations_i16(x)
        want_q, want_scale = int16_l1_activations(x)
        np.testing.assert_array_equal(scale, want_scale)
        np.testing.assert_array_equal(q, want_q)
        l1 = np.abs(q.astype(np.int64)).reshape(n, k // 128, 128).sum(axis=2)
        assert l1.max() <= 32767


def test_it_is_far_more_exact_than_the_int8_rule(rng):
    x = massive_rows(rng, 4, 1024)
    err16 = np.linalg.norm(dequantized(*_core.quantize_activations_i16(x)) - x)
    q8, s8 = quantize_activations(x)
    err8 = np.linalg.norm(dequantized(q8.astype(np.int16), s8) - x)
    # Blocks without a massive value gain ~7x (scale ~ L1/32639 against amax/127 for normal values),
    # blocks with one far more; a flat block would gain only 2x, which normal rows never are.
    assert err16 < err8 / 5, (err16, err8)

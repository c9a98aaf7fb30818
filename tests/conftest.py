"""Shared fixtures: a fresh random generator per test, its seed reported on failure."""

from __future__ import annotations

import secrets

import numpy as np
import pytest


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    seed = secrets.randbits(64)
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)

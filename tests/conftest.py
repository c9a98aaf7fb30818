"""Shared fixtures: a fresh random generator per test, its seed reported on failure."""

from __future__ import annotations

import secrets
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    seed = secrets.randbits(64)
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def model_seed() -> int:
    """One fresh seed for the session's random test models (printed, so a failure can be replayed)."""
    seed = secrets.randbits(64)
    print(f"test-model seed: {seed}")
    return seed


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    """A tied-output tiny model (the Bonsai-1.7B/4B layout)."""
    from models import write_tiny

    return write_tiny(tmp_path_factory.mktemp("models") / "tiny-tied.gguf", model_seed)


@pytest.fixture(scope="session")
def tiny_untied_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    """A tiny model with its own output matrix."""
    from models import write_tiny

    return write_tiny(tmp_path_factory.mktemp("models") / "tiny-untied.gguf", model_seed + 1, tied=False)

"""Shared fixtures: a fresh random generator per test, its seed reported on failure; the session's random
test models; an engine and server app on the embedded default model."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="module")
def default_engine() -> Iterator[Any]:
    """An ``AsyncLLM`` on the embedded default model with a fresh seed, shut down after the module."""
    import oxibonsai as ob

    e = ob.AsyncLLM(None, seed=secrets.randbits(32))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def default_app(default_engine: Any) -> Any:
    """The OpenAI-compatible app over ``default_engine``."""
    from server_support import app_for

    return app_for(default_engine)


@pytest.fixture(scope="module")
def thinking_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The OpenAI/Anthropic app over a scripted model that thinks (``test_reasoning.SCRIPT``) before it
    answers, with the qwen3 reasoning parser; shut down after the module."""
    from test_reasoning import SCRIPT

    import oxibonsai as ob

    from scripted_model import write_scripted_model
    from server_support import app_for

    engine = ob.AsyncLLM(
        write_scripted_model(tmp_path_factory.mktemp("thinking") / "m.gguf", SCRIPT),
        kv_cache_blocks=64,
        reasoning_parser="qwen3",
    )
    yield app_for(engine, reasoning_parser="qwen3")
    engine.shutdown()

"""Shared fixtures: the real default model, pulled once into the cache folder."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default model's GGUF file (SmolLM2-135M-Instruct Q4_1), pulled on demand."""
    from mashbox import registry

    return str(registry.pull(registry.DEFAULT_MODEL_ID, quiet=True))

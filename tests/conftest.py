"""Shared fixtures: the real default model, pulled once into the cache folder; and the
test tiers.

Tiers: a test that uses the real default model (SmolLM2-135M GGUF: its weights, its
tokenizer, or a real worker on it) is marked `slow`, automatically, because it asks for
the `default_model_path` fixture, directly or through another fixture; every other test
is the fast tier. So the fast tier (`python -m pytest -m "not slow"`) never needs the
model file (nor the network to pull it), and a new test lands in the right tier by the
fixtures it uses, with no marker to forget. `python -m pytest` runs both.
"""
from __future__ import annotations

import pytest

REAL_MODEL_FIXTURE = "default_model_path"


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        # fixturenames is the whole closure: fixtures of fixtures count too.
        if REAL_MODEL_FIXTURE in getattr(item, "fixturenames", ()):
            item.add_marker(slow)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default model's GGUF file (SmolLM2-135M-Instruct Q4_1), pulled on demand."""
    from mashbox import registry

    return str(registry.pull(registry.DEFAULT_MODEL_ID, quiet=True))

"""Fixtures of the engine tests: the tiny random Llama (made once per session) and its tokenizer."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import make_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_tok(tiny):
    from mashbox.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny)

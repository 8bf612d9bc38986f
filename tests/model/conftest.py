"""Model tests run torch on one intra-op thread.

The tensors here are tiny (or one small model), and on a shared, oversubscribed CPU
every parallel region can wait a whole scheduler slice for its second thread: one
thread is both faster and steadier. The previous setting is restored after each test.
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

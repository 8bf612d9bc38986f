"""The layer loop's buffers are made once, at the decoder's construction, for the most
rows a step can have (StepLimits): a step of any size up to the limit keeps them, a
bigger step is refused with a clear error instead of growing one."""
from __future__ import annotations

import pytest
import torch
from tiny import make_tiny

from mashbox import native
from mashbox.model import loader
from mashbox.model.decoder import Batch, Decoder
from mashbox.model.kernels import Kernels
from mashbox.model.kv_cache import KVCache
from mashbox.model.layer_loop import StepLimits

CPU = torch.device("cpu")
LIMITS = StepLimits(tokens=40, decode_rows=3)


def _decoder(tmp_path, dtype: torch.dtype, kernels: Kernels) -> Decoder:
    w = loader.load(str(make_tiny(tmp_path, "llama")), dtype, CPU)
    return Decoder(w.config, w.tensors, dtype, CPU, kernels=kernels, limits=LIMITS)


def _steps(d: Decoder) -> None:
    """Prefill steps of 1 to 40 tokens over 1 or 2 rows, then decode steps of 3, 1, 2 rows."""
    cache = KVCache(d.config, slots=4, ctx=128, dtype=d.dtype, device=CPU)
    for n in (1, 40, 7, 23, 2):
        d.forward(Batch.build([(0, 0, list(range(n)))]), cache)
    d.forward(Batch.build([(1, 0, list(range(30))), (2, 0, list(range(10)))]), cache)
    for rows in ((0, 1, 2), (0,), (1, 2), (0, 1, 2)):
        d.forward(Batch.build([(s, 40 + s, [5]) for s in rows], decode=(True,) * len(rows)), cache)


def _refusals(d: Decoder) -> None:
    cache = KVCache(d.config, slots=4, ctx=128, dtype=d.dtype, device=CPU)
    with pytest.raises(ValueError, match="step of 41 tokens exceeds the decoder's limit of 40"):
        d.forward(Batch.build([(0, 0, list(range(41)))]), cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_python_layers_never_replace_their_buffers(tmp_path, dtype):
    d = _decoder(tmp_path, dtype, Kernels(layers="python"))
    before = [(b.data_ptr(), tuple(b.shape)) for b in d.loop.buffers()]
    assert before[0][1][0] >= LIMITS.tokens  # sized for the limit at construction
    _steps(d)
    assert [(b.data_ptr(), tuple(b.shape)) for b in d.loop.buffers()] == before
    _refusals(d)


def test_c_layers_never_replace_their_scratch(tmp_path):
    if not native.NATIVE:
        pytest.skip("the C extension is not built")
    d = _decoder(tmp_path, torch.bfloat16, Kernels(layers="c", kernel=native.KERNEL_PORTABLE))
    before = [(b.data_ptr(), tuple(b.shape)) for b in d.loop.buffers()]
    assert len(before) == 2  # C's scratch and the Python loop's attention output
    _steps(d)
    assert [(b.data_ptr(), tuple(b.shape)) for b in d.loop.buffers()] == before
    _refusals(d)
    cache = KVCache(d.config, slots=4, ctx=128, dtype=d.dtype, device=CPU)
    with pytest.raises(ValueError, match="step of 4 decode rows exceeds the layer loop's 3"):
        d.forward(Batch.build([(s, 0, [5]) for s in range(4)], decode=(True,) * 4), cache)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="StepLimits"):
        StepLimits(tokens=0)

"""device_and_dtype: the one place that picks the device and measures the auto dtype."""
from __future__ import annotations

import pytest
import torch

from mashbox.model import device as device_mod
from mashbox.model.decoder import device_and_dtype
from mashbox.model.errors import ModelError


def test_explicit_choices_are_taken_as_given():
    assert device_and_dtype("cpu", "float32") == (torch.device("cpu"), torch.float32)
    assert device_and_dtype("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)


def test_auto_device_is_cuda_exactly_when_cuda_is_available():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert device_and_dtype("auto", "float32")[0].type == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_model_error():
    with pytest.raises(ModelError, match="cuda"):
        device_and_dtype("cuda", "float32")


@pytest.mark.parametrize("device, dtype, field", [("tpu", "float32", "device"), ("cpu", "float16", "dtype")])
def test_unknown_names_are_model_errors_naming_the_field(device, dtype, field):
    with pytest.raises(ModelError, match=field):
        device_and_dtype(device, dtype)


def test_auto_dtype_is_measured_and_logged(caplog):
    with caplog.at_level("INFO", logger="mashbox.model.device"):
        dev, dtype = device_and_dtype("cpu", "auto", hidden_size=256)
    assert dtype in (torch.float32, torch.bfloat16)
    line = next(r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage())
    assert "float32" in line and "bfloat16" in line and line.endswith(str(dtype).removeprefix("torch."))


def test_auto_dtype_picks_the_faster_one(monkeypatch):
    # The timing itself is the machine's; which one wins must follow it.
    for fast in (torch.float32, torch.bfloat16):
        monkeypatch.setattr(device_mod, "_matmul_seconds",
                            lambda dev, dt, hidden, reps, fast=fast: 1.0 if dt == fast else 2.0)
        assert device_and_dtype("cpu", "auto")[1] == fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_probe_times_the_kernel_the_decoder_runs(dtype):
    from mashbox.model.linear import BF16Linear, bf16_kernel_available

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    matmul = device_mod._linear_as_the_decoder_runs_it(w)
    assert isinstance(matmul, BF16Linear) == (dtype == torch.bfloat16 and bf16_kernel_available())
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = torch.nn.functional.linear(x.float(), w.float())
    assert (matmul(x).float() - want).abs().max().item() < 0.05 * want.abs().max().item()

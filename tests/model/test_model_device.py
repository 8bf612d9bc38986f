"""device_and_dtype: the one place that picks the device and decides the auto dtype."""
from __future__ import annotations

import pytest
import torch

from mashbox.model import device as device_mod
from mashbox.model.device import device_and_dtype
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


def test_auto_dtype_follows_the_hardware_and_is_logged(caplog):
    from mashbox.model.linear import bf16_kernel_available

    with caplog.at_level("INFO", logger="mashbox.model.device"):
        dev, dtype = device_and_dtype("cpu", "auto", hidden_size=576)
    has_bf16 = bf16_kernel_available() or bool(device_mod.CPU_BF16_FLAGS & device_mod.cpu_flags())
    assert dtype == (torch.bfloat16 if has_bf16 else torch.float32)
    line = next(r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage())
    assert f"-> {str(dtype).removeprefix('torch.')}:" in line


@pytest.mark.parametrize("own, flags, want", [
    (True, frozenset(), torch.bfloat16),
    (False, frozenset({"avx512_bf16"}), torch.bfloat16),
    (False, frozenset({"amx_bf16", "avx2"}), torch.bfloat16),
    (False, frozenset({"bf16", "asimd"}), torch.bfloat16),  # Arm
    (False, frozenset({"avx2", "avx512f"}), torch.float32),  # bfloat16 would be emulated
    (False, frozenset(), torch.float32),
])
def test_auto_dtype_rules(monkeypatch, own, flags, want):
    monkeypatch.setattr(device_mod, "own_bf16_kernel", lambda hidden: own)
    monkeypatch.setattr(device_mod, "cpu_flags", lambda: flags)
    assert device_and_dtype("cpu", "auto")[1] == want


def test_own_kernel_counts_only_for_shapes_it_packs():
    from mashbox.model.linear import bf16_kernel_available

    assert device_mod.own_bf16_kernel(576) == bf16_kernel_available()
    assert not device_mod.own_bf16_kernel(575)  # odd k: the kernel cannot pack it


def test_auto_dtype_is_the_same_on_a_busy_machine():
    """Nothing is timed: three CPU hogs (on a 2-core machine) change nothing."""
    import subprocess
    import sys

    quiet = device_and_dtype("cpu", "auto", hidden_size=576)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        busy = [device_and_dtype("cpu", "auto", hidden_size=576) for _ in range(3)]
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert busy == [quiet] * 3


@pytest.mark.parametrize("capability, want", [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16),
                                              ((7, 5), torch.float32), ((6, 1), torch.float32)])
def test_auto_dtype_on_cuda_follows_the_compute_capability(monkeypatch, capability, want):
    # the rule alone (no GPU here): bfloat16 units from compute capability 8.0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert device_mod.auto_dtype(torch.device("cuda"), 576)[0] == want

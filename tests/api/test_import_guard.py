"""The server process stays free of torch and numpy: every api / http module, the
engine client and text/ import neither (a fresh interpreter, so nothing else loaded
them first). The worker process is where tensors live."""
from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import mashbox.api, mashbox.http, mashbox.text
names = ["mashbox.engine.client"]
for package in (mashbox.api, mashbox.http, mashbox.text):
    names += [package.__name__ + "." + m.name for m in pkgutil.iter_modules(package.__path__)]
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in ("torch", "numpy") if m in sys.modules)
print(len(names), " ".join(heavy))
"""


def test_server_side_modules_import_neither_torch_nor_numpy():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, _, heavy = out.stdout.strip().partition(" ")
    assert int(count) >= 20  # the walk found the modules
    assert heavy == "", f"imported by a server-side module: {heavy}"

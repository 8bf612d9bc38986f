"""The worker runs the server's own mashbox, whatever the cwd; without the C extension it
refuses to start unless MASHBOX_NATIVE=reference asks for the slow Python reference.

Real processes: a server-side EngineClient in a fresh interpreter spawns the real worker
on the default model. "A checkout" is a copy of the source tree without the built
extension, as after `git clone` (the README's `pip install . && mashbox run` run inside
it): with it as the cwd, the worker must still map the extension of the package the
server imported (read from /proc/<pid>/maps while it is ready).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mashbox"

CLIENT = r"""
import asyncio, sys
from mashbox.config import EngineConfig, ServerConfig
from mashbox.engine.client import EngineClient, EngineStartError

async def main():
    cfg = EngineConfig(model_path=sys.argv[1], model_id="m", slots=1, ctx=64, dtype="float32")
    client = EngineClient(cfg, ServerConfig())
    await client.start()
    try:
        await client.wait_ready(timeout=float(sys.argv[2]))
        pid = client.info.pid
        maps = open(f"/proc/{pid}/maps").read()
        natives = sorted({l.split()[-1] for l in maps.splitlines() if "_native" in l})
        print("READY", natives)
    except EngineStartError as e:
        print("FATAL", e)
    finally:
        await client.stop()

asyncio.run(main())
"""


# The development venv may hold an editable install of another checkout, whose import
# hook would lend that checkout's built extension to a copy that has none; a user's
# installed package has no such hook. Every interpreter these tests start (server side
# and worker: the worker inherits PYTHONPATH) drops it first.
SITECUSTOMIZE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
"""


def _pythonpath(tmp_path: Path, first: Path) -> str:
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return os.pathsep.join([str(first), str(hooks)])


def _source_copy(dest: Path) -> Path:
    """dest/mashbox: the package's sources without the built extension (a fresh clone)."""
    shutil.copytree(PKG, dest / "mashbox", ignore=shutil.ignore_patterns("_native*.so", "__pycache__"))
    return dest


def _run_client(tmp_path: Path, model: str, cwd: Path, pythonpath: Path, env: dict | None = None,
                ready_timeout: float = 240) -> str:
    script = tmp_path / "client.py"  # outside cwd: sys.path[0] is the script's folder
    script.write_text(CLIENT)
    full_env = {k: v for k, v in os.environ.items() if k != "MASHBOX_NATIVE"}
    full_env.update(PYTHONPATH=_pythonpath(tmp_path, pythonpath), **(env or {}))
    r = subprocess.run([sys.executable, str(script), model, str(ready_timeout)], capture_output=True,
                       text=True, cwd=cwd, env=full_env, timeout=ready_timeout + 60)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_worker_imports_the_servers_package_from_inside_a_checkout(tmp_path, default_model_path):
    checkout = _source_copy(tmp_path / "checkout")
    assert not list((checkout / "mashbox").glob("_native*"))
    out = _run_client(tmp_path, default_model_path, cwd=checkout, pythonpath=ROOT)
    assert out.startswith("READY"), out
    [mapped] = eval(out.removeprefix("READY"))
    assert Path(mapped).resolve().parent == PKG


def test_worker_refuses_the_reference_unless_asked(tmp_path, default_model_path):
    site = _source_copy(tmp_path / "site")
    out = _run_client(tmp_path, default_model_path, cwd=tmp_path, pythonpath=site)
    assert out.startswith("FATAL") and "mashbox._native is not built" in out, out
    assert "MASHBOX_NATIVE=reference" in out
    out = _run_client(tmp_path, default_model_path, cwd=tmp_path, pythonpath=site,
                      env={"MASHBOX_NATIVE": "reference"})
    assert out == "READY []", out


def test_run_without_the_extension_exits_2_before_loading(tmp_path, default_model_path):
    site = _source_copy(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if k != "MASHBOX_NATIVE"}
    env["PYTHONPATH"] = _pythonpath(tmp_path, site)
    r = subprocess.run([sys.executable, "-m", "mashbox", "run", default_model_path], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "not built" in r.stderr and "MASHBOX_NATIVE=reference" in r.stderr


def test_native_module_says_why_it_is_missing(tmp_path):
    site = _source_copy(tmp_path / "site")
    code = "from mashbox import native; print(native.NATIVE, native.REFERENCE_ENV, 'not built' in native.MISSING)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": _pythonpath(tmp_path, site)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "MASHBOX_NATIVE", "True"]
    assert "refuses to start on it unless MASHBOX_NATIVE=reference" in r.stderr

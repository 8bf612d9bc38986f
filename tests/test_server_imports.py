"""The server process imports neither torch nor numpy (ARCHITECTURE.md: only the worker does).

A fresh interpreter does what `mashbox run` does before the worker starts: checks the
model (cli / registry / modelfile), loads the default model's tokenizer and chat
template, builds the engine client, the guard and every route module's routes the way
app.py does, listens on a real socket and answers a request; then 'torch', 'numpy' and
'gguf' (which imports numpy) must not be in sys.modules.
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import asyncio, socket, sys
from mashbox import cli, registry
from mashbox.modelfile import inspect
from mashbox.api import app
from mashbox.config import EngineConfig, ServerConfig
from mashbox.engine.client import EngineClient

model_id, path = registry.resolve(None, quiet=True)
inspect(path)
sc = ServerConfig(port=0)
ec = EngineConfig(model_path=str(path), model_id=model_id)
engine = EngineClient(ec, sc)
api = app.make_context(sc, ec, engine)
router = app.build_router(api, app.make_guard(sc))
api.template.encode([{"role": "user", "content": "hi"}])

async def main():
    from mashbox.http.server import serve
    server = await serve(router, sc)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    status = (await reader.readline()).decode()
    writer.close()
    await server.close()
    return status

status = asyncio.run(main())
assert status.startswith("HTTP/1.1 "), status
print(sorted(m for m in ("torch", "numpy", "gguf") if m in sys.modules))
"""


def test_server_process_imports_neither_torch_nor_numpy(default_model_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"

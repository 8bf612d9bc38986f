"""What a model path holds, read without torch or numpy: format, architecture, trained context.

The CLI checks a model here before it starts the server and the worker, so that a
missing file, a corrupt GGUF or an unsupported architecture ends with a clear message
and exit code 2 instead of a worker that dies while loading.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mashbox import gguf_meta

# What the model layer runs (torch-free module): HF model_type values, and GGUF
# general.architecture values (a narrower set: no "mistral").
from mashbox.model.model_config import ARCHITECTURES, GGUF_ARCHITECTURES


class ModelFileError(Exception):
    """The path holds no model mashbox can run; the message says why."""


@dataclass(frozen=True)
class ModelFile:
    path: Path
    format: str  # "gguf" | "hf"
    arch: str
    context_length: int


def _gguf(path: Path) -> ModelFile:
    try:
        meta = gguf_meta.read(path)
    except gguf_meta.GGUFMetaError as e:
        raise ModelFileError(f"{path}: corrupt or unreadable GGUF file ({e})") from e
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror})") from e
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: GGUF file without general.architecture")
    ctx = meta.get(f"{arch}.context_length", 0)
    if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 0:
        raise ModelFileError(f"{path}: {arch}.context_length is {ctx!r}, not a count of tokens")
    # A truncated file must fail here, not in the worker: every tensor's bytes lie inside
    # the file.
    if meta.data_end > meta.file_size:
        raise ModelFileError(f"{path}: truncated GGUF file ({meta.file_size} bytes, tensors need "
                             f"{meta.data_end})")
    return ModelFile(path, "gguf", arch, ctx)


def _hf(path: Path) -> ModelFile:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelFileError(f"{path}: no config.json (expected a Hugging Face model folder or a .gguf file)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelFileError(f"{cfg_path}: not valid JSON ({e})") from e
    arch = cfg.get("model_type") or ""
    if not any((path / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")):
        raise ModelFileError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return ModelFile(path, "hf", arch, int(cfg.get("max_position_embeddings") or 0))


def inspect(path: Path) -> ModelFile:
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"no such file or folder: {path}")
    mf = _hf(path) if path.is_dir() else _gguf(path)
    supported = tuple(GGUF_ARCHITECTURES) if mf.format == "gguf" else ARCHITECTURES
    if mf.arch not in supported:
        raise ModelFileError(
            f"{path}: unsupported architecture {mf.arch!r} (mashbox runs {', '.join(supported)} "
            f"from {'GGUF files' if mf.format == 'gguf' else 'model folders'})"
        )
    return mf

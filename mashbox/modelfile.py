"""What a model path holds, read without torch: format, architecture, trained context.

The CLI checks a model here before it starts the server and the worker, so that a
missing file, a corrupt GGUF or an unsupported architecture ends with a clear message
and exit code 2 instead of a worker that dies while loading.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
    import gguf  # numpy only; memory-maps the file

    try:
        reader = gguf.GGUFReader(str(path))
        arch_field = reader.fields.get("general.architecture")
        if arch_field is None:
            raise ModelFileError(f"{path}: GGUF file without general.architecture")
        arch = arch_field.contents()
        ctx_field = reader.fields.get(f"{arch}.context_length")
        ctx = int(ctx_field.contents()) if ctx_field is not None else 0
        # A truncated file must fail here, not in the worker: every tensor's bytes lie
        # inside the file.
        size = path.stat().st_size
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
        if end > size:
            raise ModelFileError(f"{path}: truncated GGUF file ({size} bytes, tensors need {end})")
    except ModelFileError:
        raise
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors...
        raise ModelFileError(f"{path}: corrupt or unreadable GGUF file ({type(e).__name__}: {e})") from e
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

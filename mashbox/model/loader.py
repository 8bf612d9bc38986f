"""Loading a model's weights: an HF folder of safetensors or a .gguf file.

Rules:
- `path` is an HF model folder (config.json + model.safetensors, or shards listed in
  model.safetensors.index.json) or a .gguf file. Tensors come back with HF names in the
  requested dtype and device, converted one at a time so two copies of the weights are
  never alive together. Parts of the decoder's fused weights (q|k|v, gate|up) are
  written side by side into one buffer each (fused_layout.py); they are still returned
  under their own names, as views.
- A tied embedding is kept once, as model.embed_tokens.weight (the decoder uses it as
  the output head); a stray lm_head.weight next to it is dropped.
- Everything that can go wrong with the files raises ModelError naming the path.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from mashbox.model.block_weight import KERNEL_TYPES
from mashbox.model.errors import ModelError
from mashbox.model.fused_layout import FusedLayout
from mashbox.model.gguf_weights import GGUFWeights
from mashbox.model.model_config import ModelConfig

log = logging.getLogger(__name__)

_SAFETENSORS_BITS = {"F32": 32, "F16": 16, "BF16": 16, "F64": 64}


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names -> weights in the requested dtype/device (or BlockWeight)
    weights_file: str  # the .gguf file, or the folder's safetensors (index) file
    bpw: float  # bits per weight as stored in the file


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def read_config(path: str) -> ModelConfig:
    """The model's config without loading any tensor."""
    if is_gguf(path):
        return GGUFWeights(path).config
    return ModelConfig.from_hf(_read_json(_hf_file(path, "config.json")))


def load(path: str, dtype: torch.dtype, device: torch.device, blocks: bool = False) -> LoadedWeights:
    """blocks: a GGUF's 2-d tensors of the types csrc's kernels read (block_weight.
    KERNEL_TYPES) come as BlockWeight, kept in the file's blocks; other types (F16, BF16,
    F32, and block types without a kernel) are dequantized as before."""
    if is_gguf(path):
        weights = GGUFWeights(path)
        tensors: dict[str, torch.Tensor] = {}
        with torch.inference_mode(False), torch.no_grad():
            layout = FusedLayout(weights.config, dtype, device)
            for name, value in weights.tensors(dtype, device, layout, KERNEL_TYPES if blocks else ()):
                tensors[name] = value
        _drop_tied_head(weights.config, tensors)
        return LoadedWeights(weights.config, tensors, path, weights.bits_per_weight)
    return _load_hf(path, dtype, device)


def _hf_file(folder: str, name: str) -> str:
    if not os.path.isdir(folder):
        if os.path.exists(folder):
            raise ModelError(f"{folder} is neither a model folder nor a .gguf file")
        raise ModelError(f"model path not found: {folder}")
    file = os.path.join(folder, name)
    if not os.path.isfile(file):
        raise ModelError(f"{folder} has no {name}")
    return file


def _read_json(file: str) -> dict:
    try:
        with open(file, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {file}: {e}") from None


def _shards(folder: str) -> tuple[str, list[str]]:
    """(file that names the weights, shard files in load order)."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return single, [single]
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        raise ModelError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelError(f"{index} has no weight_map")
    files = sorted(set(weight_map.values()))
    for name in files:
        if not os.path.isfile(os.path.join(folder, name)):
            raise ModelError(f"shard {name} listed in {index} is missing")
    return index, [os.path.join(folder, name) for name in files]


def _load_hf(folder: str, dtype: torch.dtype, device: torch.device) -> LoadedWeights:
    from safetensors import SafetensorError, safe_open

    config = ModelConfig.from_hf(_read_json(_hf_file(folder, "config.json")))
    weights_file, files = _shards(folder)
    tensors: dict[str, torch.Tensor] = {}
    layout = FusedLayout(config, dtype, device)
    bits = elements = 0
    start = last = time.monotonic()
    for i, file in enumerate(files):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if not name.startswith(("model.", "lm_head.")) or "rotary_emb" in name:
                        continue
                    meta = f.get_slice(name)
                    n = meta.get_shape()
                    count = 1
                    for d in n:
                        count *= d
                    bits += _SAFETENSORS_BITS.get(meta.get_dtype(), 16) * count
                    elements += count
                    dest = layout.destination(name, tuple(n))
                    if dest is None:
                        tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
                    else:
                        tensors[name] = dest.copy_(f.get_tensor(name))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"cannot read {file} (corrupt or truncated?): {e}") from None
        now = time.monotonic()
        if now - last >= 2.0 or (len(files) > 1 and i == len(files) - 1):
            last = now
            log.info("loading %s: %d/%d shards, %.1f s", folder, i + 1, len(files), now - start)
    _drop_tied_head(config, tensors)
    return LoadedWeights(config, tensors, weights_file, bits / max(1, elements))


def _drop_tied_head(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)

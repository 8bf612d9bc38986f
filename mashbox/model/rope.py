"""The rotary position table: cos and sin of every position a KV slot can hold.

Rules:
- Rotate-half layout (HF's): dimension i pairs with i + head_dim/2. GGUF llama files
  are un-permuted at load so this one layout serves every file.
- Frequencies are computed in float32 from config.rope_theta and config.rope_scaling
  ("linear", "llama3", "freq_factors"); the table is then cast to the model dtype.
- `sin` is stored with the sign of rotate-half folded in, so applying rope is
  x * cos + swap_halves(x) * sin.
"""
from __future__ import annotations

import math

import torch

from mashbox.model.model_config import ModelConfig


def inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim/2] float32 angular frequency of each rotated pair."""
    dim = config.head_dim
    freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return freq / float(scaling["factor"])
    if kind == "freq_factors":
        return freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling.get("original_max_position_embeddings", config.max_position_embeddings))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RopeTable:
    def __init__(self, config: ModelConfig, length: int, dtype: torch.dtype, device: torch.device):
        half = config.head_dim // 2
        angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq(config))  # [len, half]
        cos, sin = angles.cos(), angles.sin()
        self.length = length
        self.cos = torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype)  # [len, head_dim]
        self.sin = torch.cat((-sin, sin), dim=-1).to(device=device, dtype=dtype)  # [len, head_dim]
        self.half = half

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; cos, sin [T, 1, head_dim] (rows of this table)."""
        swapped = torch.cat((x[..., self.half:], x[..., :self.half]), dim=-1)
        return x * cos + swapped * sin

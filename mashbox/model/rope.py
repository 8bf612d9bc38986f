"""The rotary position table: cos and sin of every position a KV slot can hold.

Rules:
- Rotate-half layout (HF's): dimension i pairs with i + head_dim/2. GGUF llama files
  are un-permuted at load so this one layout serves every file.
- Frequencies are computed in float32 from config.rope_theta and config.rope_scaling
  ("linear", "llama3", "freq_factors", "yarn", "dynamic"); the table is then cast to
  the model dtype. Everything a scaling changes lives in this table: the C rope kernel
  and the torch path both read its rows, nothing else knows the scaling type.
- YaRN scales cos and sin by its attention factor (transformers' attention_scaling), so
  q.k comes out multiplied by its square with no change to the attention itself.
- Dynamic NTK is fixed per table, never per step: transformers recomputes the base from
  the longest position of each forward, which would make a row's logits depend on what
  ran before it and beside it. Here the base is raised once, for the table's length (the
  slot's ctx, set at load), to what transformers uses for a forward of exactly ctx
  tokens; at ctx <= max_position_embeddings that is plain rope. So every row of every
  step sees the same frequencies, short prompts included.
- `sin` is stored with the sign of rotate-half folded in, so applying rope is
  x * cos + swap_halves(x) * sin.
"""
from __future__ import annotations

import math

import torch

from mashbox.model.model_config import ModelConfig


def _exponents(dim: int) -> torch.Tensor:
    """[dim/2] float32: 0, 2/dim, 4/dim, ... (the power of the base per pair)."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def inv_freq(config: ModelConfig, ctx: int) -> torch.Tensor:
    """[head_dim/2] float32 angular frequency of each rotated pair, for slots of ctx tokens."""
    dim = config.head_dim
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "dynamic":
        # NTK-aware: the base grows with the context, long wavelengths stretch most
        factor = float(scaling["factor"])
        trained = config.max_position_embeddings
        seq = max(ctx, trained)
        base = config.rope_theta * ((factor * seq / trained) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** _exponents(dim))
    freq = 1.0 / (config.rope_theta ** _exponents(dim))
    if scaling is None:
        return freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return freq / float(scaling["factor"])
    if kind == "freq_factors":
        return freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "yarn":
        return _yarn(config, freq)
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


def _yarn(config: ModelConfig, freq: torch.Tensor) -> torch.Tensor:
    """YaRN's NTK-by-parts: pairs that turn more than beta_fast times over the original
    context keep their frequency, pairs that turn less than beta_slow times are divided by
    factor, and the pairs between blend linearly."""
    y = config.rope_scaling
    dim, base = config.head_dim, config.rope_theta
    original = y["original_max_position_embeddings"]

    def pair_of(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(y["beta_fast"]), pair_of(y["beta_slow"])
    if y["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (frequency kept), 0: interpolate (divided by factor)
    pos_freqs = base ** _exponents(dim)
    interpolated = 1.0 / (float(y["factor"]) * pos_freqs)
    extrapolated = 1.0 / pos_freqs
    return interpolated * (1 - keep) + extrapolated * keep


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "yarn":
        return float(scaling["attention_factor"])
    return 1.0


class RopeTable:
    def __init__(self, config: ModelConfig, length: int, dtype: torch.dtype, device: torch.device):
        """`length` rows, positions 0 .. length-1; `length` is the slot's ctx (dynamic NTK's
        frequencies are fixed from it)."""
        half = config.head_dim // 2
        angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq(config, length))  # [len, half]
        scale = attention_factor(config)
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.length = length
        self.cos = torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype)  # [len, head_dim]
        self.sin = torch.cat((-sin, sin), dim=-1).to(device=device, dtype=dtype)  # [len, head_dim]
        self.half = half

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; cos, sin [T, 1, head_dim] (rows of this table)."""
        swapped = torch.cat((x[..., self.half:], x[..., :self.half]), dim=-1)
        return x * cos + swapped * sin

"""ModelConfig: the hyper-parameters of one decoder, whatever file they came from.

Rules:
- One frozen dataclass for Llama, Mistral, Qwen2 and Qwen3. The architectures differ
  only by flags (attention_bias, qk_norm, tie_word_embeddings, rope_scaling,
  sliding_window); the decoder reads the flags, never `arch`.
- `from_hf(d)` reads an HF config.json dict (transformers 4 `rope_theta` /
  `rope_scaling` and transformers 5 `rope_parameters` alike). The GGUF reader builds
  one from the file's metadata (gguf_weights.py).
- rope_scaling is None or a dict with "rope_type" in ROPE_TYPES; anything else raises
  ModelError when the config is built, not at the first forward. Every file's spelling
  (HF's legacy "type", transformers 5's rope_parameters, GGUF's rope.scaling.* keys) is
  turned into one dict per type, defaults filled in (`rope_params`), so rope.py reads
  no optional key.
- `with_rope_scaling(kind, factor, ctx)` is the CLI's --rope-scaling / --rope-scale
  applied over the file's own scaling (see its docstring for the rules).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from mashbox.model.errors import ModelError

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# GGUF general.architecture -> our arch. Mistral 7B files are written as "llama".
# Torch-free, like this whole module: mashbox/modelfile.py checks a path against these
# before any worker starts.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# "linear": positions divided by factor. "llama3": Llama-3.1 frequency-band scaling.
# "freq_factors": per-frequency divisors given as a list (what llama.cpp stores in a
# GGUF's rope_freqs tensor for Llama-3.1 models). "yarn": YaRN (NTK-by-parts
# interpolation, cos/sin scaled by an attention factor). "dynamic": dynamic NTK, the
# rope base raised for the slot's context (rope.py says why it is fixed at load).
ROPE_TYPES = ("linear", "llama3", "freq_factors", "yarn", "dynamic")
# the context-extension types: what --rope-scaling may ask for or replace. llama3 and
# freq_factors are frequencies a model was trained with, not an extension.
EXTENSION_ROPE_TYPES = ("linear", "yarn", "dynamic")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2); o_proj bias too when the weights have one
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)
    sliding_window: Optional[int] = None  # keys older than this many positions are masked

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ModelError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelError(f"model config field {name} must be a positive integer, not {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelError(f"head_dim must be even for rope, not {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in ROPE_TYPES:
                raise ModelError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
            if kind == "freq_factors" and len(self.rope_scaling["factors"]) != self.head_dim // 2:
                raise ModelError("rope freq_factors must have head_dim / 2 entries")
            if kind in EXTENSION_ROPE_TYPES:
                factor = self.rope_scaling.get("factor")
                if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
                    raise ModelError(f"rope_scaling {kind} needs a positive factor, not {factor!r}")
            if kind == "yarn":
                y = self.rope_scaling
                if not (isinstance(y.get("original_max_position_embeddings"), int)
                        and y["original_max_position_embeddings"] >= 1):
                    raise ModelError("rope_scaling yarn needs a positive original_max_position_embeddings")
                for key in ("attention_factor", "beta_fast", "beta_slow"):
                    if not isinstance(y.get(key), float) or not math.isfinite(y[key]) or y[key] <= 0:
                        raise ModelError(f"rope_scaling yarn field {key} must be a positive number, "
                                         f"not {y.get(key)!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Weights of the decoder, counting a tied embedding once (norms and biases ignored)."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size + head

    @property
    def rope_type(self) -> Optional[str]:
        return None if self.rope_scaling is None else self.rope_scaling["rope_type"]

    def describe_rope(self) -> str:
        """One line for the log: the rope that positions past the trained length get."""
        s = self.rope_scaling
        if s is None:
            return (f"plain rope (no scaling): positions past {self.max_position_embeddings} are "
                    "extrapolated; --rope-scaling yarn stretches the rope to fit")
        kind = s["rope_type"]
        if kind == "yarn":
            return (f"yarn rope scaling, factor {s['factor']:g} over {s['original_max_position_embeddings']} "
                    f"original positions, attention factor {s['attention_factor']:.4f}")
        if kind == "dynamic":
            return f"dynamic NTK rope scaling, factor {s['factor']:g}, base fixed from ctx"
        if kind == "linear":
            return f"linear rope scaling, factor {s['factor']:g}"
        return f"the model's {kind} rope frequencies"

    def with_rope_scaling(self, kind: Optional[str], factor: Optional[float], ctx: int) -> "ModelConfig":
        """This config with the CLI's --rope-scaling `kind` / --rope-scale `factor` applied
        for slots of `ctx` tokens.

        - kind None and factor None: the file's own scaling, unchanged.
        - kind "none": no context-extension scaling (the file's linear / yarn / dynamic
          dropped; llama3 and freq_factors kept: they are the trained frequencies).
        - kind "linear" | "yarn" | "dynamic": that scaling replaces the file's own; factor
          None means ctx / the trained length (at least 1). YaRN's original context is the
          file's own original_max_position_embeddings when its scaling was YaRN, else the
          trained length (max_position_embeddings).
        - kind None with a factor: the file's own extension type with that factor, or
          linear when the file has none (llama-server's --rope-scale does the same).
        A model trained with llama3 / freq_factors frequencies takes no extension over
        them: ModelError.
        """
        own = self.rope_type
        if kind is None and factor is None:
            return self
        if kind == "none":
            if own in EXTENSION_ROPE_TYPES:
                return dataclasses.replace(self, rope_scaling=None)
            return self
        if kind is None:
            kind = own if own in EXTENSION_ROPE_TYPES else "linear"
        if kind not in EXTENSION_ROPE_TYPES:
            raise ModelError(f"rope scaling {kind!r} is not one of none, {', '.join(EXTENSION_ROPE_TYPES)}")
        if own is not None and own not in EXTENSION_ROPE_TYPES:
            raise ModelError(f"--rope-scaling {kind}: the model's rope already uses {own} frequencies, "
                             "which mashbox cannot combine with another scaling")
        original = self.max_position_embeddings
        if own == "yarn":
            original = self.rope_scaling["original_max_position_embeddings"]
        if factor is None:
            factor = max(1.0, ctx / original)
        kept = {}
        if own == kind == "yarn":  # the file's ramp bounds stay; the attention factor follows the factor
            kept = {k: self.rope_scaling[k] for k in ("beta_fast", "beta_slow", "truncate")}
        params = rope_params(kind, dict(kept, factor=float(factor)), original)
        return dataclasses.replace(self, rope_scaling=params)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Build from a transformers config.json dict."""
        arch = d.get("model_type")
        if arch not in ARCHITECTURES:
            named = ", ".join(d.get("architectures") or []) or "unknown"
            raise ModelError(
                f"unsupported architecture {arch!r} ({named}); supported: {', '.join(ARCHITECTURES)}"
            )
        if d.get("mlp_bias"):
            raise ModelError("mlp_bias is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ModelError(f"unsupported hidden_act {d.get('hidden_act')!r} (only silu)")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            head_dim = int(d.get("head_dim") or hidden // heads)
            theta, scaling = _hf_rope(d)
            return cls(
                arch=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                sliding_window=_hf_sliding_window(arch, d),
            )
        except KeyError as e:
            raise ModelError(f"config.json lacks field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelError(f"config.json has a malformed field: {e}") from None


def _hf_rope(d: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling or None) from either transformers config layout."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type layout
        params = params["full_attention"]
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    params = dict(params)
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    params.pop("type", None)
    params.pop("rope_type", None)
    # transformers (standardize_rope_params) reads a top-level original_max_position_embeddings
    # first (Phi-3 style), then the scaling's own, then max_position_embeddings
    original = d.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if original is not None and kind in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = original
    return theta, rope_params(kind, params, int(d.get("max_position_embeddings", 2048)))


def rope_params(kind: str, params: dict, max_positions: int) -> dict:
    """One scaling dict of `kind` with its defaults filled in, as rope.py reads it.

    yarn (transformers' defaults): original_max_position_embeddings defaults to the
    trained length; a missing factor is max_position_embeddings / original (DeepSeek
    style); attention_factor defaults to 0.1 ln(factor) + 1 (or the mscale /
    mscale_all_dim ratio); beta_fast 32, beta_slow 1; truncate True."""
    out = dict(params, rope_type=kind)
    if kind != "yarn":
        return out
    original = int(out.get("original_max_position_embeddings") or max_positions)
    factor = out.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    attention = out.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = out.get("mscale"), out.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention = yarn_mscale(factor)
    out.update(original_max_position_embeddings=original, factor=factor,
               attention_factor=float(attention), beta_fast=float(out.get("beta_fast") or 32.0),
               beta_slow=float(out.get("beta_slow") or 1.0), truncate=bool(out.get("truncate", True)))
    return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _hf_sliding_window(arch: str, d: dict) -> Optional[int]:
    window = d.get("sliding_window")
    if arch == "mistral":
        return int(window) if window else None
    if arch in ("qwen2", "qwen3") and d.get("use_sliding_window"):
        kinds = set(d.get("layer_types") or ["sliding_attention"])
        if kinds != {"sliding_attention"}:
            raise ModelError("sliding window on only some layers (use_sliding_window with "
                             "max_window_layers) is not supported")
        return int(window) if window else None
    return None

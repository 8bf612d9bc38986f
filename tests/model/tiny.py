"""Tiny random models made with transformers, for any test that needs a real model folder.

    from tiny import make_tiny        # tests/model is on sys.path for its own tests;
    folder = make_tiny(tmp_path, "qwen3")  # other folders: sys.path.insert(0, <tests/model>)

Weights are drawn from a seeded generator with a spread large enough that the logits
differ by whole units (transformers' default init gives near-constant logits, which
would let a broken decoder pass a parity test). The folder holds config.json and
model.safetensors (or shards), written by transformers itself; `reference(folder)`
loads it back as a float32 transformers model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

VOCAB = 128

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

# name -> (transformers config class name, overrides)
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(rope_theta=10000.0)),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=500000.0)),
    "llama3_rope": ("LlamaConfig", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        rope_theta=50000.0)),
    "llama_mha": ("LlamaConfig", dict(num_key_value_heads=4, attention_bias=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None, rope_theta=1000000.0)),
    "mistral_window": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", dict(head_dim=16, num_key_value_heads=1, tie_word_embeddings=True)),
    # head_dim 128 (Qwen3's default): transformers' GGUF loader does not read key_length
    "qwen3_wide": ("Qwen3Config", dict(head_dim=128, num_key_value_heads=1, tie_word_embeddings=True)),
}


def make_config(variant: str):
    import transformers

    cls_name, overrides = VARIANTS[variant]
    kwargs = dict(BASE)
    kwargs.update(overrides)
    return getattr(transformers, cls_name)(**kwargs)


def make_tiny(dest: Path, variant: str = "llama", seed: int = 0,
              max_shard_size: Optional[str] = None) -> Path:
    """Write a tiny random `variant` model under dest/variant and return the folder."""
    import transformers

    torch.manual_seed(seed)
    config = make_config(variant)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 * 1.5)
    folder = Path(dest) / variant
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def reference(folder: Path):
    """The transformers model of `folder`, float32, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of every position of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()

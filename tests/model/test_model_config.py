"""ModelConfig.from_hf: both transformers config layouts, and the errors that name a field."""
from __future__ import annotations

import pytest

from mashbox.model.errors import ModelError
from mashbox.model.model_config import ModelConfig

# A Llama-3.2-style config.json as transformers 4 wrote it (rope_theta + rope_scaling).
LLAMA32 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "vocab_size": 128256,
    "hidden_act": "silu", "mlp_bias": False, "attention_bias": False,
}


def test_transformers_4_layout():
    cfg = ModelConfig.from_hf(LLAMA32)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 32.0
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (16, 32, 8, 64)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm


def test_transformers_5_layout_gives_the_same_config():
    d = dict(LLAMA32)
    d["rope_parameters"] = dict(d.pop("rope_scaling"), rope_theta=d.pop("rope_theta"))
    assert ModelConfig.from_hf(d) == ModelConfig.from_hf(LLAMA32)


def test_old_type_key_and_default_rope():
    d = dict(LLAMA32, rope_scaling={"type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf(d).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ModelConfig.from_hf(dict(LLAMA32, rope_scaling=None)).rope_scaling is None
    assert ModelConfig.from_hf(dict(LLAMA32, rope_scaling={"rope_type": "default"})).rope_scaling is None


@pytest.mark.parametrize("change, named", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
    ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}, "phi3"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_key_value_heads": 7}, "num_kv_heads"),
    ({"vocab_size": 0}, "vocab_size"),
])
def test_unsupported_or_malformed_configs_name_the_field(change, named):
    with pytest.raises(ModelError, match=named):
        ModelConfig.from_hf(dict(LLAMA32, **change))


def test_missing_field_is_named():
    d = dict(LLAMA32)
    del d["intermediate_size"]
    with pytest.raises(ModelError, match="intermediate_size"):
        ModelConfig.from_hf(d)


def test_qwen2_has_biases_and_qwen3_has_qk_norm():
    base = dict(LLAMA32, rope_scaling=None)
    assert ModelConfig.from_hf(dict(base, model_type="qwen2")).attention_bias
    q3 = ModelConfig.from_hf(dict(base, model_type="qwen3"))
    assert q3.qk_norm and not q3.attention_bias

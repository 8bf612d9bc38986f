"""Rope scaling past the trained length: linear, YaRN and dynamic NTK.

- Tiny random models whose config.json asks for each scaling (written by transformers),
  run by our decoder in chunked prefills beside another slot and decodes, at positions
  past the original context: every row's logits equal transformers' to 1e-4.
- Dynamic NTK: transformers recomputes the base from each forward's longest position;
  we fix it from the slot's ctx (rope.py). The parity that can hold is with
  transformers' forward of exactly ctx tokens, and it holds for every chunking; at a ctx
  within the trained length dynamic is plain rope, as transformers' is there.
- YaRN in bfloat16 through the own C kernel (which reads the table's scaled cos/sin
  rows) stays close to transformers' float32.
- GGUF rope.scaling.* keys (llama.cpp's names and meaning) read into the same scaling,
  and a YaRN GGUF gives transformers' YaRN logits.
- ModelConfig.with_rope_scaling: the CLI flags applied over the file's own scaling.
"""
from __future__ import annotations

import math

import gguf
import pytest
import torch
from tiny import BASE, make_tiny, reference, reference_logits

from mashbox.model import loader
from mashbox.model.decoder import Batch, Decoder
from mashbox.model.errors import ModelError
from mashbox.model.kv_cache import KVCache
from mashbox.model.model_config import ModelConfig
from mashbox.model.rope import RopeTable, attention_factor, inv_freq

CPU = torch.device("cpu")
ATOL = 1e-4
CTX = 64  # the slot's ctx: twice the original 32 positions of every variant below
TRAINED = 32

# name -> (transformers config class name, overrides); trained context 32 everywhere
SCALED = {
    "linear": ("LlamaConfig", dict(max_position_embeddings=TRAINED,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "dynamic": ("LlamaConfig", dict(max_position_embeddings=TRAINED,
                                    rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    # Qwen3-style: max_position_embeddings is the extended length, the original inside
    "yarn": ("LlamaConfig", dict(max_position_embeddings=4 * TRAINED, rope_theta=10000.0,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": TRAINED})),
    "yarn_qwen3": ("Qwen3Config", dict(head_dim=32, max_position_embeddings=4 * TRAINED,
                                       rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 16,
                                                     "original_max_position_embeddings": TRAINED})),
}


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("scaled")


@pytest.fixture
def scaled(scaled_dir, monkeypatch):
    """make(name) -> folder of the tiny model `name` of SCALED (written once per module)."""
    import tiny

    def make(name):
        folder = scaled_dir / name
        if not folder.exists():
            monkeypatch.setitem(tiny.VARIANTS, name, SCALED[name])
            make_tiny(scaled_dir, name)
        return folder
    return make


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chunked_logits(decoder, config, a, b, ctx=CTX, dtype=torch.float32):
    """Slot 2 runs `a` (prefill 0..20 beside slot 0's prefill of b, 20..40 alone, then
    decodes beside slot 0's decodes); returns {position: logits row} for every row of a."""
    cache = KVCache(config, slots=3, ctx=ctx, dtype=dtype, device=CPU)
    out = {}
    logits = decoder.forward(Batch.build([(0, 0, b[:30]), (2, 0, a[:20])]), cache)
    out[19] = logits[1]
    out[39] = decoder.forward(Batch.build([(2, 20, a[20:40])]), cache)[0]
    for pos in range(40, len(a)):
        rows = [(2, pos, a[pos:pos + 1])]
        if 30 + pos - 40 < len(b):
            rows.insert(0, (0, 30 + pos - 40, b[30 + pos - 40:31 + pos - 40]))
        out[pos] = decoder.forward(Batch.build(rows), cache)[len(rows) - 1]
    return out


def _decoder(folder, dtype=torch.float32):
    weights = loader.load(str(folder), dtype, CPU)
    return weights.config, Decoder(weights.config, weights.tensors, dtype, CPU)


@pytest.mark.parametrize("name", sorted(SCALED))
def test_scaled_rope_matches_transformers_past_the_original_context(scaled, name):
    folder = scaled(name)
    config, decoder = _decoder(folder)
    assert config.rope_type == name.split("_")[0]
    ref = reference(folder)
    a, b = _ids(CTX, 1), _ids(CTX, 2)
    want = reference_logits(ref, a)  # one forward of exactly CTX tokens (dynamic: see above)
    got = _chunked_logits(decoder, config, a, b)
    assert max(got) == CTX - 1 and min(p for p in got if p >= 40) > TRAINED
    for pos, row in got.items():
        err = (row - want[pos]).abs().max().item()
        assert err < ATOL, f"{name}: position {pos}: max |diff| {err}"
    # the scaling matters at these positions: plain rope gives other logits
    plain = dict(ref.config.to_dict(), rope_scaling=None, rope_parameters=None)
    plain_cfg = ModelConfig.from_hf(plain)
    assert plain_cfg.rope_scaling is None
    assert not torch.allclose(inv_freq(plain_cfg, CTX), inv_freq(config, CTX))


def test_dynamic_ntk_is_fixed_from_the_slot_ctx(scaled):
    folder = scaled("dynamic")
    ref = reference(folder)
    a = _ids(CTX, 3)
    full = reference_logits(ref, a)
    short = reference_logits(reference(folder), a[:48])
    # transformers: the first 48 positions change with how long the forward was
    assert (full[:48] - short).abs().max().item() > 1e-2
    # ours: ctx 64 gives the 64-token forward's logits for any chunking and any prefix
    config, decoder = _decoder(folder)
    cache = KVCache(config, slots=1, ctx=CTX, dtype=torch.float32, device=CPU)
    rows = decoder.forward(Batch.build([(0, 0, a[:48])]), cache)
    assert (rows[0] - full[47]).abs().max().item() < ATOL
    # a ctx within the trained length: plain rope, as transformers at <= 32 positions
    config, decoder = _decoder(folder)
    cache = KVCache(config, slots=1, ctx=TRAINED, dtype=torch.float32, device=CPU)
    got = decoder.forward(Batch.build([(0, 0, a[:TRAINED])]), cache)[0]
    want = reference_logits(reference(folder), a[:TRAINED])[-1]
    assert (got - want).abs().max().item() < ATOL
    plain = ModelConfig.from_hf(dict(ref.config.to_dict(), rope_scaling=None, rope_parameters=None))
    assert torch.equal(inv_freq(config, TRAINED), inv_freq(plain, TRAINED))


def test_yarn_table_scales_cos_and_sin_by_its_attention_factor(scaled):
    config = loader.read_config(str(scaled("yarn")))
    m = attention_factor(config)
    assert m == pytest.approx(0.1 * math.log(4.0) + 1.0)
    table = RopeTable(config, CTX, torch.float32, CPU)
    norm = (table.cos[:, :4] ** 2 + table.sin[:, :4] ** 2).sqrt()  # each pair's cos^2 + sin^2
    assert torch.allclose(norm, torch.full_like(norm, m), atol=1e-5)


def test_yarn_in_bfloat16_stays_close_to_transformers(scaled):
    """bfloat16 runs the own C kernel where it is built: its rope_kv reads the table's
    scaled rows. Logits within bfloat16 roundings of transformers' float32 ones at
    positions past 32."""
    folder = scaled("yarn")
    a, b = _ids(CTX, 4), _ids(CTX, 5)
    want = reference_logits(reference(folder), a)
    config, dec16 = _decoder(folder, torch.bfloat16)
    got = _chunked_logits(dec16, config, a, b, dtype=torch.bfloat16)
    for pos in (39, 50, CTX - 1):
        scale = want[pos].abs().max().item()
        err = (got[pos] - want[pos]).abs().max().item()
        assert err < 0.05 * scale, f"position {pos}: |diff| {err} against logits up to {scale}"


# -- GGUF rope.scaling.* ------------------------------------------------------------------

def _gguf_with_rope_keys(tmp_path, monkeypatch, folder, keys: dict) -> str:
    """A llama GGUF of the tiny model at `folder` with extra rope.scaling.* metadata."""
    from test_model_gguf import _write_gguf

    real = gguf.GGUFWriter

    class Writer(real):
        def write_header_to_file(self, *args, **kwargs):
            for key, value in keys.items():
                full = f"llama.rope.scaling.{key}"
                if isinstance(value, str):
                    self.add_string(full, value)
                elif isinstance(value, int):
                    self.add_uint32(full, value)
                else:
                    self.add_float32(full, value)
            return super().write_header_to_file(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    path = str(tmp_path / "scaled.gguf")
    _write_gguf(reference(folder), "llama", path, gguf.GGMLQuantizationType.F32)
    monkeypatch.setattr(gguf, "GGUFWriter", real)
    return path


def test_gguf_yarn_keys_give_transformers_yarn(scaled, tmp_path, monkeypatch):
    folder = scaled("yarn")
    path = _gguf_with_rope_keys(tmp_path, monkeypatch, folder, {
        "type": "yarn", "factor": 4.0, "original_context_length": TRAINED})
    config = loader.read_config(path)
    assert config.rope_scaling == loader.read_config(str(folder)).rope_scaling  # defaults filled alike
    _, decoder = _decoder(path)
    a, b = _ids(CTX, 6), _ids(CTX, 7)
    want = reference_logits(reference(folder), a)
    for pos, row in _chunked_logits(decoder, config, a, b).items():
        assert (row - want[pos]).abs().max().item() < ATOL, pos


def test_gguf_yarn_optional_keys_and_linear(scaled, tmp_path, monkeypatch):
    folder = scaled("yarn")
    path = _gguf_with_rope_keys(tmp_path, monkeypatch, folder, {
        "type": "yarn", "factor": 8.0, "attn_factor": 0.5, "yarn_beta_fast": 16.0,
        "yarn_beta_slow": 2.0, "yarn_ext_factor": -1.0})
    y = loader.read_config(path).rope_scaling
    assert y["original_max_position_embeddings"] == 4 * TRAINED  # default: context_length
    assert (y["factor"], y["beta_fast"], y["beta_slow"]) == (8.0, 16.0, 2.0)
    assert y["attention_factor"] == pytest.approx(0.5 * (0.1 * math.log(8.0) + 1.0))
    (tmp_path / "lin").mkdir()
    path = _gguf_with_rope_keys(tmp_path / "lin", monkeypatch, folder, {"type": "linear", "factor": 2.5})
    assert loader.read_config(path).rope_scaling == {"rope_type": "linear", "factor": 2.5}


@pytest.mark.parametrize("keys, named", [
    ({"type": "longrope", "factor": 2.0}, "longrope"),
    ({"type": "yarn", "factor": 2.0, "yarn_ext_factor": 0.5}, "yarn_ext_factor"),
    ({"type": "yarn", "factor": 2.0, "yarn_log_multiplier": 0.1}, "yarn_log_multiplier"),
    ({"type": "yarn"}, "rope.scaling.factor"),
])
def test_gguf_rope_keys_we_cannot_honour_are_refused(scaled, tmp_path, monkeypatch, keys, named):
    path = _gguf_with_rope_keys(tmp_path, monkeypatch, scaled("linear"), keys)
    with pytest.raises(ModelError, match=named):
        loader.read_config(path)


# -- the flags over the file's own scaling ---------------------------------------------------

PLAIN = ModelConfig.from_hf(dict(model_type="llama", vocab_size=128, hidden_size=64,
                                 intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=8192))


def test_flags_apply_over_a_plain_model():
    assert PLAIN.with_rope_scaling(None, None, 32768) is PLAIN
    assert PLAIN.with_rope_scaling("none", None, 32768) is PLAIN
    y = PLAIN.with_rope_scaling("yarn", None, 32768).rope_scaling
    assert (y["rope_type"], y["factor"], y["original_max_position_embeddings"]) == ("yarn", 4.0, 8192)
    assert y["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert PLAIN.with_rope_scaling("dynamic", 2.0, 32768).rope_scaling == {"rope_type": "dynamic",
                                                                          "factor": 2.0}
    assert PLAIN.with_rope_scaling(None, 3.0, 32768).rope_scaling == {"rope_type": "linear", "factor": 3.0}
    # a ctx within the trained length: factor 1 (no change to the frequencies)
    assert PLAIN.with_rope_scaling("linear", None, 4096).rope_scaling["factor"] == 1.0


def test_flags_over_a_model_with_its_own_scaling():
    qwen = ModelConfig.from_hf(dict(model_type="qwen3", vocab_size=128, hidden_size=64,
                                    intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                    max_position_embeddings=40960, rope_scaling={
                                        "rope_type": "yarn", "factor": 4.0, "beta_fast": 16,
                                        "original_max_position_embeddings": 32768}))
    assert qwen.with_rope_scaling("none", None, 131072).rope_scaling is None
    y = qwen.with_rope_scaling(None, 2.0, 65536).rope_scaling  # --rope-scale alone: own type
    assert (y["rope_type"], y["factor"], y["beta_fast"], y["original_max_position_embeddings"]) == (
        "yarn", 2.0, 16.0, 32768)
    assert qwen.with_rope_scaling("yarn", None, 131072).rope_scaling["factor"] == 4.0
    llama3 = ModelConfig.from_hf(dict(model_type="llama", vocab_size=128, hidden_size=64,
                                      intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}))
    assert llama3.with_rope_scaling("none", None, 65536) is llama3
    with pytest.raises(ModelError, match="llama3"):
        llama3.with_rope_scaling("yarn", None, 65536)


@pytest.mark.parametrize("scaling, named", [
    ({"rope_type": "yarn", "factor": -1.0}, "factor"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "dynamic", "factor": float("nan")}, "factor"),
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": -3}, "beta_fast"),
    ({"rope_type": "longrope", "factor": 2.0}, "longrope"),
])
def test_malformed_scalings_name_the_field(scaling, named):
    with pytest.raises(ModelError, match=named):
        ModelConfig.from_hf(dict(model_type="llama", vocab_size=128, hidden_size=64,
                                 intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 rope_scaling=scaling))

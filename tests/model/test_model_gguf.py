"""GGUF files: our loader against transformers' own GGUF loader, and our dequantization
against gguf-py's reference.

- The real default model (llama arch, Q4_1 + Q8_0 + F32, q/k rows permuted by
  llama.cpp's converter): logits for a fixed token sequence equal transformers' logits
  from AutoModelForCausalLM.from_pretrained(dir, gguf_file=name) in float32.
- Tiny GGUF files written here with gguf.GGUFWriter from tiny random transformers models
  (llama with permuted q/k, qwen2 with biases and a tied head, qwen3 with q/k norms):
  loaded by us and by transformers, both equal to the original transformers model.
- Every tensor type: written with GGUFWriter (quantized by gguf-py where it can, random
  blocks with sane scales for the K-quants it cannot quantize), read back and
  dequantized by us and by gguf.quants.dequantize.
- Truncated, corrupt and unsupported files raise ModelError.
"""
from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from tiny import make_tiny, reference, reference_logits

from mashbox.model import loader, quants
from mashbox.model.decoder import Batch, Decoder
from mashbox.model.errors import ModelError
from mashbox.model.gguf_weights import GGUFWeights
from mashbox.model.kv_cache import KVCache

CPU = torch.device("cpu")

# A fixed prompt of SmolLM2 ids (a chat-formatted question), prefilled in two chunks and
# then decoded a token at a time.
DEFAULT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
               7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282,
               4649, 47, 2, 198, 1, 520, 9531, 198]


def _our_logits_for_every_position(decoder, config, ids, first_chunk, second_chunk):
    """Prefill ids in two chunks, then decode the rest one token at a time."""
    cache = KVCache(config, slots=2, ctx=64, dtype=torch.float32, device=CPU)
    out = {}
    pos = 0
    for n in (first_chunk, second_chunk):
        logits = decoder.forward(Batch.build([(1, pos, ids[pos:pos + n])]), cache)
        pos += n
        out[pos - 1] = logits[0]
    while pos < len(ids):
        logits = decoder.forward(Batch.build([(1, pos, [ids[pos]])]), cache)
        out[pos] = logits[0]
        pos += 1
    return out


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(default_model_path):
    import transformers

    weights = loader.load(default_model_path, torch.float32, CPU)
    cfg = weights.config
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size) == ("llama", 30, 9, 3, 576)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert 4.5 < weights.bpw < 6.5
    decoder = Decoder(cfg, weights.tensors, torch.float32, CPU)
    ours = _our_logits_for_every_position(decoder, cfg, DEFAULT_IDS, 20, 9)
    del decoder

    folder, name = os.path.split(default_model_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    expected = reference_logits(ref, DEFAULT_IDS)
    for pos, row in ours.items():
        want = expected[pos]
        err = (row - want).abs().max().item()
        assert err < 2e-3 * max(1.0, want.abs().max().item()), f"position {pos}: max |diff| {err}"
        assert row.argmax() == want.argmax()


# ---- tiny GGUF files written from tiny transformers models -------------------------------

_LAYER_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of llama models (rotate-half -> interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, gguf_arch: str, path: str, qtype: gguf.GGMLQuantizationType) -> None:
    c = model.config
    head_dim = c.to_dict().get("head_dim") or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, gguf_arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(int(qtype))
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = value.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_LAYER_GGUF[rest]}"
        if gguf_arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in gname else c.num_key_value_heads
            arr = _permute_like_llama_cpp(arr, heads)
        if arr.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("variant, gguf_arch, qtype", [
    ("llama", "llama", gguf.GGMLQuantizationType.F32),
    ("llama_tied", "llama", gguf.GGMLQuantizationType.Q8_0),
    ("qwen2", "qwen2", gguf.GGMLQuantizationType.F32),
    ("qwen3_wide", "qwen3", gguf.GGMLQuantizationType.F16),
])
def test_tiny_gguf_matches_transformers(tmp_path, variant, gguf_arch, qtype):
    import transformers

    original = reference(make_tiny(tmp_path, variant))
    path = str(tmp_path / f"{variant}.gguf")
    _write_gguf(original, gguf_arch, path, qtype)

    weights = loader.load(path, torch.float32, CPU)
    assert weights.config.arch == gguf_arch
    assert weights.config.tie_word_embeddings == original.config.tie_word_embeddings
    decoder = Decoder(weights.config, weights.tensors, torch.float32, CPU)
    ids = torch.randint(0, original.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = _our_logits_for_every_position(decoder, weights.config, ids, 8, 6)

    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    exact = qtype == gguf.GGMLQuantizationType.F32
    want_gguf = reference_logits(from_gguf, ids)
    want_original = reference_logits(original, ids)
    for pos, row in ours.items():
        assert (row - want_gguf[pos]).abs().max().item() < 1e-4, f"vs transformers' GGUF loader, position {pos}"
        # quantized weights drift from the originals; exact ones must not
        bound = 1e-4 if exact else 0.15 * want_original[pos].abs().max().item()
        assert (row - want_original[pos]).abs().max().item() < bound, f"position {pos}"


# ---- dequantization of every supported type ----------------------------------------------

def _random_k_blocks(qtype: gguf.GGMLQuantizationType, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks whose float16 scales are sane (random bytes could be inf/NaN)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
    scale_offsets = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[qtype.name]
    for off in scale_offsets:
        raw[:, off:off + 2] = rng.uniform(0.001, 0.1, size=(blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


def test_every_supported_type_dequantizes_like_gguf_py(tmp_path):
    rng = np.random.default_rng(0)
    rows, cols = 6, 512
    path = str(tmp_path / "quants.gguf")
    w = gguf.GGUFWriter(path, "llama")
    written = {}
    for name in quants.SUPPORTED_TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        try:
            raw = gguf.quants.quantize(data, qtype)
            how = "quantized by gguf-py"
        except NotImplementedError:
            block_elems, _ = gguf.GGML_QUANT_SIZES[qtype]
            raw = _random_k_blocks(qtype, rows * cols // block_elems, rng).reshape(rows, -1)
            how = "random blocks"
        if name == "F32":
            w.add_tensor(f"t.{name}", data)
        else:
            w.add_tensor(f"t.{name}", raw, raw_dtype=qtype)
        written[name] = how
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert {"Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "Q4_K", "Q6_K"} <= set(written)

    reader = gguf.GGUFReader(path, "c")
    seen = set()
    for t in reader.tensors:
        name = t.tensor_type.name
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols)
        assert np.isfinite(want).all()
        raw = torch.from_numpy(t.data.reshape(-1).view(np.uint8)).reshape(rows, -1)
        for dtype in (torch.float32, torch.bfloat16):
            got = quants.dequantize(raw, name, cols, dtype, CPU)
            assert got.dtype == dtype and got.shape == (rows, cols)
            if dtype == torch.float32:
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{name} ({written[name]})")
            else:
                assert torch.equal(got, torch.from_numpy(want).to(torch.bfloat16)), name
        seen.add(name)
    assert seen == set(quants.SUPPORTED_TYPES)


def test_dequantize_works_in_chunks(monkeypatch):
    rng = np.random.default_rng(1)
    data = rng.standard_normal((40, 64)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1))
    whole = quants.dequantize(raw, "Q4_1", 64, torch.float32, CPU)
    monkeypatch.setattr(quants, "CHUNK_ELEMENTS", 64 * 3)  # 3 rows a chunk, the last one short
    chunked = quants.dequantize(raw, "Q4_1", 64, torch.float32, CPU)
    assert torch.equal(whole, chunked)
    np.testing.assert_array_equal(whole.numpy(), gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_1))


# ---- broken files ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    original = reference(make_tiny(tmp, "qwen2"))
    path = str(tmp / "small.gguf")
    _write_gguf(original, "qwen2", path, gguf.GGMLQuantizationType.Q8_0)
    return path


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.01, 100])
def test_truncated_gguf_raises_model_error(small_gguf, tmp_path, keep):
    data = open(small_gguf, "rb").read()
    size = int(len(data) * keep) if keep < 1 else keep
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:size])
    with pytest.raises(ModelError, match="cut.gguf"):
        loader.load(str(cut), torch.float32, CPU)


def test_not_a_gguf_raises_model_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + os.urandom(4000))
    with pytest.raises(ModelError, match="bad.gguf"):
        loader.read_config(str(bad))
    with pytest.raises(ModelError, match="not found"):
        loader.load(str(tmp_path / "missing.gguf"), torch.float32, CPU)


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = str(tmp_path / "phi.gguf")
    w = gguf.GGUFWriter(path, "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="phi3"):
        loader.read_config(path)


def test_read_config_loads_no_tensor(small_gguf, tmp_path):
    cfg = loader.read_config(small_gguf)
    assert (cfg.arch, cfg.attention_bias, cfg.tie_word_embeddings) == ("qwen2", True, True)
    copy = tmp_path / "copy.gguf"
    shutil.copy(small_gguf, copy)
    assert GGUFWeights(str(copy)).config == cfg


def test_long_loads_log_progress(small_gguf, caplog, monkeypatch):
    from mashbox.model import gguf_weights

    monkeypatch.setattr(gguf_weights, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level("INFO", logger="mashbox.model.gguf_weights"):
        loader.load(small_gguf, torch.float32, CPU)
    progress = [r.getMessage() for r in caplog.records if "tensors, " in r.getMessage()]
    assert progress and "%" in progress[-1]
    assert any(r.getMessage().startswith("loaded ") for r in caplog.records)


def test_unsupported_tensor_type_is_named_before_loading(tmp_path):
    path = str(tmp_path / "iq.gguf")
    qtype = gguf.GGMLQuantizationType.IQ4_NL
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, block_bytes), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="IQ4_NL"):
        loader.read_config(path)

"""Our decoder against transformers on tiny random models, float32, to 1e-4.

Each variant is saved by transformers as safetensors, loaded by our loader, and run
through a sequence of mixed varlen batches: a prompt prefilled in two chunks next to
full prefills of other slots, then decodes of several slots at different positions
(slot sets that take the batched-decode path and ones that take the per-row path), and
a lone decode. Every row's logits must equal transformers' logits for the same position
of the same sequence.
"""
from __future__ import annotations

import json

import pytest
import torch
from tiny import VARIANTS, make_tiny, reference, reference_logits

from mashbox.model import loader
from mashbox.model.decoder import Batch, Decoder
from mashbox.model.errors import ModelError
from mashbox.model.kv_cache import KVCache

CPU = torch.device("cpu")
ATOL = 1e-4

# (slot, sequence length); sequences are random ids drawn per test.
SEQS = {"a": (0, 24), "b": (1, 18), "c": (7, 12)}

# Each step: rows of (sequence, first position, number of new tokens).
STEPS = [
    [("a", 0, 12), ("b", 0, 13), ("c", 0, 8)],  # a: first chunk of its prompt
    [("a", 12, 8), ("b", 13, 1), ("c", 8, 1)],  # a: second chunk; b, c: decodes (slots 1, 7: per row)
    [("a", 20, 1), ("b", 14, 1), ("c", 9, 1)],  # three decodes (slots 0, 1, 7: per row)
    [("b", 15, 1), ("a", 21, 1)],  # two decodes in adjacent slots: the batched path
    [("c", 10, 1)],  # a lone decode
    [("a", 22, 2), ("b", 16, 1), ("c", 11, 1)],  # a short chunk after decodes, with decodes
]


def _load(folder, dtype=torch.float32, batch_invariant=None):
    weights = loader.load(str(folder), dtype, CPU)
    return weights, Decoder(weights.config, weights.tensors, dtype, CPU, batch_invariant=batch_invariant)


def _run_steps(decoder, cache, seqs):
    """Yield (sequence name, position of its last new token, logits row) for every row."""
    for step in STEPS:
        rows = [(SEQS[name][0], start, seqs[name][start:start + n]) for name, start, n in step]
        logits = decoder.forward(Batch.build(rows), cache)
        assert logits.shape == (len(rows), decoder.config.vocab_size)
        assert logits.dtype == torch.float32
        for i, (name, start, n) in enumerate(step):
            yield name, start + n - 1, logits[i]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["rows-attend-alone", "decodes-batched"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mixed_batches_match_transformers(tiny_dir, variant, batch_invariant):
    folder = tiny_dir / variant
    if not folder.exists():
        make_tiny(tiny_dir, variant)
    ref = reference(folder)
    weights, decoder = _load(folder, batch_invariant=batch_invariant)
    assert weights.tensors == {}, "the decoder takes ownership of the weights"
    gen = torch.Generator().manual_seed(7)
    seqs = {name: torch.randint(0, ref.config.vocab_size, (n,), generator=gen).tolist()
            for name, (_, n) in SEQS.items()}
    expected = {name: reference_logits(ref, ids) for name, ids in seqs.items()}
    cache = KVCache(weights.config, slots=8, ctx=32, dtype=torch.float32, device=CPU)
    checked = 0
    for name, pos, row in _run_steps(decoder, cache, seqs):
        want = expected[name][pos]
        assert want.std() > 0.5, "random weights must give logits that differ"
        err = (row - want).abs().max().item()
        assert err < ATOL, f"{variant}: sequence {name} position {pos}: max |diff| {err}"
        checked += 1
    assert checked == sum(len(s) for s in STEPS)


def test_cpu_bfloat16_decode_is_batch_invariant(tiny_dir):
    """A decode row's logits are bit-identical alone and beside other rows of other
    lengths (decodes and a prefill chunk). bfloat16 only: float32 linears change kernel
    with the row count (see decoder.py)."""
    weights, decoder = _load(make_tiny(tiny_dir, "qwen3"), torch.bfloat16)
    assert decoder.batch_invariant
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 17, 30, 12)]
    cache = KVCache(weights.config, slots=4, ctx=64, dtype=torch.bfloat16, device=CPU)
    for slot, ids in enumerate(prompts):
        decoder.forward(Batch.build([(slot, 0, ids[:-1])]), cache)
    last = [(slot, len(ids) - 1, ids[-1:]) for slot, ids in enumerate(prompts)]
    alone = decoder.forward(Batch.build(last[:1]), cache)[0]
    beside = decoder.forward(Batch.build(last), cache)[0]
    beside_reversed = decoder.forward(Batch.build(last[::-1]), cache)[-1]
    with_prefill = decoder.forward(Batch.build([last[0], (3, 0, prompts[3])]), cache)[0]
    assert torch.equal(alone, beside)
    assert torch.equal(alone, beside_reversed)
    assert torch.equal(alone, with_prefill)


def test_config_flags_follow_the_architecture(tiny_dir):
    flags = {}
    for variant in ("llama", "llama_tied", "llama3_rope", "mistral_window", "qwen2", "qwen3"):
        cfg = loader.read_config(str(make_tiny(tiny_dir, variant)))
        flags[variant] = (cfg.arch, cfg.tie_word_embeddings, cfg.attention_bias, cfg.qk_norm,
                          (cfg.rope_scaling or {}).get("rope_type"), cfg.sliding_window)
    assert flags == {
        "llama": ("llama", False, False, False, None, None),
        "llama_tied": ("llama", True, False, False, None, None),
        "llama3_rope": ("llama", False, False, False, "llama3", None),
        "mistral_window": ("mistral", False, False, False, None, 8),
        "qwen2": ("qwen2", True, True, False, None, None),
        "qwen3": ("qwen3", False, False, True, None, None),
    }


def test_tied_embedding_is_held_once_unless_the_head_is_packed(tiny_dir, monkeypatch):
    import mashbox.model.decoder as decoder_mod

    folder = str(make_tiny(tiny_dir, "llama_tied"))
    weights = loader.load(folder, torch.float32, CPU)
    assert "lm_head.weight" not in weights.tensors
    packed = Decoder(weights.config, weights.tensors, torch.float32, CPU)
    # on CPU the head is packed for oneDNN: a copy, the embedding stays plain for its gather
    assert packed._packed and packed.lm_head is not packed.embed
    # bfloat16 on the own kernel: the embedding reads its rows from the packed head, and
    # the plain copy is gone
    weights = loader.load(folder, torch.bfloat16, CPU)
    own = Decoder(weights.config, weights.tensors, torch.bfloat16, CPU)
    if own.kernels.linears == "csrc":
        assert own.embed is None
        ids = torch.tensor([0, 5, 127, 5])
        plain = loader.load(folder, torch.bfloat16, CPU).tensors["model.embed_tokens.weight"]
        assert torch.equal(own._embed(ids), plain[ids])
    monkeypatch.setattr(decoder_mod, "_packs_linears", lambda device, dtype: False)
    weights = loader.load(folder, torch.float32, CPU)
    decoder = Decoder(weights.config, weights.tensors, torch.float32, CPU)
    assert decoder.lm_head.weight is decoder.embed


def test_sharded_folder_loads_like_a_single_file(tmp_path):
    single = make_tiny(tmp_path / "one", "qwen3")
    sharded = make_tiny(tmp_path / "many", "qwen3", max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a = loader.load(str(single), torch.float32, CPU)
    b = loader.load(str(sharded), torch.float32, CPU)
    assert b.weights_file.endswith("model.safetensors.index.json")
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name


def test_bfloat16_runs_close_to_float32(tiny_dir):
    folder = make_tiny(tiny_dir, "qwen2")
    ids = list(range(3, 40))
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        weights, decoder = _load(folder, dtype)
        assert decoder.embed is None or decoder.embed.dtype == dtype
        cache = KVCache(weights.config, 2, 64, dtype, CPU)
        assert cache.k.dtype == dtype
        outs.append(decoder.forward(Batch.build([(1, 0, ids)]), cache))
    assert outs[1].dtype == torch.float32
    assert (outs[0] - outs[1]).abs().max().item() < 0.25
    assert outs[0].argmax() == outs[1].argmax()


def test_kv_is_written_only_at_the_rows_slots_and_positions(tiny_dir):
    weights, decoder = _load(make_tiny(tiny_dir, "llama"))
    cache = KVCache(weights.config, slots=3, ctx=16, dtype=torch.float32, device=CPU)
    decoder.forward(Batch.build([(2, 0, [5, 6, 7]), (0, 4, [9])]), cache)
    # [layers, slots, kv_heads, capacity, head_dim] -> written[slot, position]
    written = cache.k.abs().sum(dim=(0, 2, 4)) > 0
    want = torch.zeros(3, cache.capacity, dtype=torch.bool)
    want[2, 0:3] = True
    want[0, 4] = True
    assert torch.equal(written, want)
    assert torch.equal(cache.v.abs().sum(dim=(0, 2, 4)) > 0, want)


def test_kv_cache_shape_and_size():
    from tiny import make_config

    from mashbox.model.model_config import ModelConfig

    cfg = ModelConfig.from_hf(make_config("qwen3").to_dict())
    cache = KVCache(cfg, slots=3, ctx=20, dtype=torch.bfloat16, device=CPU)
    # capacity: the decoder's key width for ctx (it reads keys in whole blocks)
    assert cache.ctx == 20 and cache.capacity == 128
    assert cache.k.shape == (cfg.num_layers, 3, cfg.num_kv_heads, 128, cfg.head_dim)
    assert cache.nbytes == KVCache.bytes_for(cfg, 3, 20, torch.bfloat16)
    assert KVCache(cfg, slots=1, ctx=1024, dtype=torch.bfloat16, device=CPU).capacity == 1024
    assert KVCache(cfg, slots=1, ctx=1025, dtype=torch.bfloat16, device=CPU).capacity == 1536
    assert KVCache(cfg, slots=1, ctx=129, dtype=torch.bfloat16, device=CPU).capacity == 512


def test_batch_that_does_not_fit_the_cache_is_refused(tiny_dir):
    weights, decoder = _load(make_tiny(tiny_dir, "llama"))
    cache = KVCache(weights.config, slots=2, ctx=8, dtype=torch.float32, device=CPU)
    with pytest.raises(ValueError, match="does not fit"):
        decoder.forward(Batch.build([(0, 6, [1, 2, 3])]), cache)
    with pytest.raises(ValueError, match="does not fit"):
        decoder.forward(Batch.build([(2, 0, [1])]), cache)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    with pytest.raises(ModelError, match="gpt2"):
        loader.read_config(str(tmp_path))
    with pytest.raises(ModelError, match="gpt2"):
        loader.load(str(tmp_path), torch.float32, CPU)


def test_missing_and_corrupt_folders_raise_model_error(tmp_path, tiny_dir):
    with pytest.raises(ModelError, match="not found"):
        loader.load(str(tmp_path / "nowhere"), torch.float32, CPU)
    folder = make_tiny(tmp_path, "llama")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelError, match="model.safetensors"):
        loader.load(str(folder), torch.float32, CPU)
    weights.unlink()
    with pytest.raises(ModelError, match="neither model.safetensors"):
        loader.load(str(folder), torch.float32, CPU)


def test_weights_that_do_not_match_the_config_raise_model_error(tiny_dir):
    weights = loader.load(str(make_tiny(tiny_dir, "llama")), torch.float32, CPU)
    weights.tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ModelError, match="up_proj"):
        Decoder(weights.config, weights.tensors, torch.float32, CPU)


@pytest.mark.parametrize("variant", ["qwen2", "llama"])
def test_fused_weights_are_the_loaded_buffers_not_copies(tiny_dir, variant, monkeypatch):
    import mashbox.model.decoder as decoder_mod

    # unpacked weights (CUDA, or a CPU torch without oneDNN); packing then reorders each
    # fused buffer into a new one and drops the old
    monkeypatch.setattr(decoder_mod, "_packs_linears", lambda device, dtype: False)
    weights = loader.load(str(make_tiny(tiny_dir, variant)), torch.float32, CPU)
    a = "model.layers.1.self_attn."
    q_ptr = weights.tensors[a + "q_proj.weight"].data_ptr()
    gate_ptr = weights.tensors["model.layers.1.mlp.gate_proj.weight"].data_ptr()
    bias_ptr = weights.tensors[a + "q_proj.bias"].data_ptr() if weights.config.attention_bias else None
    decoder = Decoder(weights.config, weights.tensors, torch.float32, CPU)
    layer = decoder.layers[1]
    assert layer.qkv.weight.data_ptr() == q_ptr  # TorchLinear: the plain weight and bias
    assert layer.gate_up.weight.data_ptr() == gate_ptr
    if bias_ptr is not None:
        assert layer.qkv.bias.data_ptr() == bias_ptr


def test_fuse_copies_parts_that_are_not_adjacent():
    from mashbox.model.fused_layout import fuse

    buf = torch.arange(24.0).reshape(6, 4)
    assert fuse([buf[0:2], buf[2:6]]).data_ptr() == buf.data_ptr()
    apart = fuse([buf[0:2], buf[3:6]])  # a gap: must be a real concatenation
    assert torch.equal(apart, torch.cat([buf[0:2], buf[3:6]]))
    swapped = fuse([buf[2:4], buf[0:2]])
    assert torch.equal(swapped, torch.cat([buf[2:4], buf[0:2]]))


def test_the_decoder_packs_its_weights_into_one_arena(tmp_path):
    from mashbox.model import linear

    if not linear.bf16_kernel_available():
        pytest.skip("no AVX512-BF16 here")
    weights = loader.load(str(make_tiny(tmp_path, "qwen2")), torch.bfloat16, torch.device("cpu"))
    decoder = Decoder(weights.config, weights.tensors, torch.bfloat16, torch.device("cpu"))
    packed = [w.packed for layer in decoder.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    packed.append(decoder.lm_head.packed)
    storage = {p.untyped_storage().data_ptr() for p in packed}
    assert len(storage) == 1, "one buffer"
    starts = [p.data_ptr() for p in packed]
    assert starts == sorted(starts), "in the order a step reads them"

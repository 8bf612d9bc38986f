"""A token's logits do not depend on how its request was scheduled (decoder.py, batch_invariant).

Bit-identical (torch.equal), in bfloat16 and float32, on tiny random models and the real
default model: one whole prefill; the same prompt prefilled in chunks of 1, 7 and the
rest; the prompt but its last token prefilled, then that token alone (what a prefix-cache
hit recomputes); that token beside other rows (decodes and a prefill chunk); and decode
steps alone against the same steps beside other slots' decodes and a prefill chunk. In
bfloat16, decode rows (Batch.row_decode) attend on csrc's kernel, prompt rows on SDPA.
"""
from __future__ import annotations

import random

import pytest
import torch
from tiny import make_tiny

from mashbox import native
from mashbox.model import linear, loader
from mashbox.model.attention_plan import padded_queries as _padded_queries
from mashbox.model.decoder import Batch, Decoder
from mashbox.model.kernels import Kernels
from mashbox.model.kv_cache import KVCache

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float32]
# bfloat16 linears run on mashbox's kernel where the CPU has AVX512-BF16, else on oneDNN
# (with padding rows): both must hold; csrc's portable kernel (the same bits, plain C)
# runs on every machine, so csrc's paths are tested where AVX512-BF16 is missing too
# (bf16-sdpa: oneDNN's linears and SDPA's attention, prompt rows included: the padded,
# masked path that float32 and CUDA take)
# (bf16-sdpa-prefill: csrc's linears and decode attention, prompt rows on SDPA, as "auto"
# picks on a CPU with AMX; bf16-portable forces csrc's prefill kernel, whatever the CPU)
KERNELS = [(torch.bfloat16, Kernels()), (torch.bfloat16, Kernels(linears="onednn")),
           (torch.bfloat16, Kernels(linears="onednn", attention="sdpa")),
           (torch.bfloat16, Kernels(kernel=native.KERNEL_PORTABLE, prefill="csrc")), (torch.float32, Kernels()),
           (torch.bfloat16, Kernels(prefill="sdpa"))]
KERNEL_IDS = ["bf16", "bf16-onednn", "bf16-sdpa", "bf16-portable", "f32", "bf16-sdpa-prefill"]


def _onednn_packs_bf16() -> bool:
    """oneDNN packs bfloat16 linear weights here (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT
    and raises on an AVX2-only CPU)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
        return True
    except (RuntimeError, AttributeError):
        return False


ONEDNN_BF16 = _onednn_packs_bf16()
NO_ONEDNN_BF16 = pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN packs no bfloat16 linears on this CPU")
KERNELS = [pytest.param(*k, marks=NO_ONEDNN_BF16) if k[1].linears == "onednn" else k for k in KERNELS]
if linear.bf16_kernel_available():  # csrc's AVX512-BF16 prefill kernel, forced where "auto" takes SDPA
    KERNELS.append((torch.bfloat16, Kernels(prefill="csrc")))
    KERNEL_IDS.append("bf16-csrc-prefill")
# csrc's kernels, forced: the portable one everywhere, AVX512-BF16 where the CPU has it
CSRC_KERNELS, CSRC_KERNEL_IDS = map(list, zip(*[(native.KERNEL_PORTABLE, "portable")]
                                               + ([(native.KERNEL_AVX512BF16, "avx512bf16")]
                                                  if linear.bf16_kernel_available() else [])
                                               + ([(native.KERNEL_AVX2, "avx2")] if native.avx2_supported() else [])))


def _decoder(path: str, dtype: torch.dtype, kernels: Kernels = Kernels()) -> Decoder:
    weights = loader.load(path, dtype, CPU)
    decoder = Decoder(weights.config, weights.tensors, dtype, CPU, kernels=kernels)
    assert decoder.batch_invariant, "batch invariance is the CPU default"
    csrc_runs = linear.bf16_kernel_available() or kernels.kernel != 0
    if kernels.linears == "onednn":
        assert decoder.kernels.linears == "onednn"
    elif dtype == torch.bfloat16 and csrc_runs and decoder._packed:
        assert decoder.kernels.linears == "csrc" and decoder._min_rows == 1, "no padding rows on the own kernel"
    if dtype == torch.bfloat16 and csrc_runs and kernels.attention != "sdpa":
        assert decoder.kernels.attention == "csrc", "decode rows attend on csrc's kernel (model/attention.py)"
    return decoder


def _check_schedules(decoder: Decoder, prompt: list[int], ctx: int, vocab: int) -> None:
    """Slots 0..3 take the same prompt through four schedules; slots 4 and 5 are company."""
    cache = KVCache(decoder.config, slots=6, ctx=ctx, dtype=decoder.dtype, device=CPU)
    fwd = lambda rows, decode=(): decoder.forward(Batch.build(rows, decode=decode), cache)  # noqa: E731
    n = len(prompt)
    gen = torch.Generator().manual_seed(3)
    other = torch.randint(0, vocab, (13,), generator=gen).tolist()

    whole = fwd([(0, 0, prompt)])[0]
    first = fwd([(1, 0, prompt[:1])])[0]
    eighth = fwd([(1, 1, prompt[1:8])])[0]
    chunked = fwd([(1, 8, prompt[8:])])[0]
    assert torch.equal(first, fwd([(4, 0, prompt[:1])])[0]), "a 1-token prefill chunk"
    assert torch.equal(eighth, fwd([(4, 0, prompt[:8])])[0]), "a chunk after a 1-token chunk"
    assert torch.equal(whole, chunked), "chunks of 1, 7 and the rest"
    # every layer's K/V of every position, not only the last logits: in the default-model
    # test the whole prefill reads 640 keys (two SDPA key blocks, the second all masked
    # for positions < 512), the first two chunks 64 keys (one block)
    assert torch.equal(cache.k[:, 0, :, :n], cache.k[:, 1, :, :n])
    assert torch.equal(cache.v[:, 0, :, :n], cache.v[:, 1, :, :n])

    fwd([(2, 0, prompt[:-1])])
    assert torch.equal(whole, fwd([(2, n - 1, prompt[-1:])])[0]), "the last prompt token alone"

    fwd([(3, 0, prompt[:-1])])
    fwd([(5, 0, other)])
    beside = fwd([(5, 13, [7]), (4, 0, prompt[: n // 2]), (3, n - 1, prompt[-1:])])
    assert torch.equal(whole, beside[2]), "the last prompt token beside a decode and a prefill"

    tok = int(whole.argmax())
    for i in range(3):  # slot 0 alone; slots 1-3 (same history) beside each other, slot 5's
        # decode and slot 4's prefill chunk
        alone = fwd([(0, n + i, [tok])], decode=(True,))[0]
        together = fwd([(1, n + i, [tok]), (5, 14 + i, [9]), (2, n + i, [tok]), (3, n + i, [tok])],
                       decode=(True,) * 4)
        mixed = fwd([(4, n // 2 + 3 * i, prompt[n // 2 + 3 * i:n // 2 + 3 * i + 3]), (1, n + i, [tok])],
                    decode=(False, True))
        for got in (together[0], together[2], together[3], mixed[1]):
            assert torch.equal(alone, got), f"decode step {i}"
        tok = int(alone.argmax())


@pytest.mark.parametrize("dtype,kernels", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("variant", ["llama", "llama_mha", "mistral_window", "qwen3_tied", "qwen2"])
def test_tiny_model_schedules_give_identical_logits(tmp_path, variant, dtype, kernels):
    decoder = _decoder(str(make_tiny(tmp_path, variant)), dtype, kernels)
    prompt = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_schedules(decoder, prompt, ctx=64, vocab=128)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_default_model_schedules_give_identical_logits(default_model_path, dtype):
    """600 prompt tokens: past SDPA's 512-key block, so the chunked rows' queries meet
    whole and partly masked key blocks."""
    decoder = _decoder(default_model_path, dtype)
    vocab = decoder.config.vocab_size
    prompt = torch.randint(0, vocab, (600,), generator=torch.Generator().manual_seed(2)).tolist()
    _check_schedules(decoder, prompt, ctx=640, vocab=vocab)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_default_model_random_schedules_give_identical_kv(default_model_path, dtype):
    """Random chunkings of 90, 260 and 590 token prompts (key widths 128, 512 and 1024),
    beside a decoding slot and short prefills: every layer's K/V and the last logits
    equal one whole prefill's. (Keys read in blocks of 64 failed this at about one
    position in a few hundred.)"""
    decoder = _decoder(default_model_path, dtype)
    vocab = decoder.config.vocab_size
    cache = KVCache(decoder.config, slots=4, ctx=700, dtype=dtype, device=CPU)
    fwd = lambda rows: decoder.forward(Batch.build(rows), cache)  # noqa: E731
    rng = random.Random(11)
    for n in (90, 260, 590):
        prompt = [rng.randrange(vocab) for _ in range(n)]
        whole = fwd([(0, 0, prompt)])[0]
        fwd([(2, 0, prompt[:5])])
        pos, other = 0, 5
        while pos < n:
            k = min(n - pos, rng.choice([1, 2, 3, 5, 11, 13, 31, 33, 64, 100, 257]))
            rows = [(1, pos, prompt[pos:pos + k])]
            if rng.random() < 0.6:
                rows.insert(rng.randint(0, 1), (2, other, [7]))
                other += 1
            if rng.random() < 0.3:
                rows.append((3, 0, prompt[:rng.randint(1, 40)]))
            last = fwd(rows)[[r[0] for r in rows].index(1)]
            pos += k
        assert torch.equal(cache.k[:, 0, :, :n], cache.k[:, 1, :, :n])
        assert torch.equal(cache.v[:, 0, :, :n], cache.v[:, 1, :, :n])
        assert torch.equal(whole, last)


@pytest.mark.slow
@NO_ONEDNN_BF16
@pytest.mark.parametrize("pad", ["linear_rows", "sdpa_queries"])
def test_default_model_without_padding_logits_change(default_model_path, monkeypatch, pad):
    """The tests above can fail: in bfloat16 on oneDNN, without padding rows to the linears
    a decode row alone differs from the same row beside another; without padding SDPA's
    queries the last prompt token alone differs from the whole prefill."""
    import mashbox.model.attention_plan as plan_mod
    import mashbox.model.decoder as decoder_mod

    if pad == "linear_rows":
        monkeypatch.setattr(decoder_mod, "_MIN_ROWS", {})
    else:
        monkeypatch.setattr(plan_mod, "_QUERY_MULTIPLE", {})
    # shown with oneDNN's linears and SDPA's attention (csrc's prefill kernel pads nothing);
    # on mashbox's linears these prompts do not expose the SDPA query blocks (the padding
    # stays: SDPA's kernel is the same)
    decoder = _decoder(default_model_path, torch.bfloat16, Kernels(linears="onednn", attention="sdpa"))
    cache = KVCache(decoder.config, slots=3, ctx=64, dtype=torch.bfloat16, device=CPU)
    fwd = lambda rows: decoder.forward(Batch.build(rows), cache)  # noqa: E731
    prompt = torch.randint(0, decoder.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = fwd([(0, 0, prompt)])[0]
    fwd([(1, 0, prompt)])
    fwd([(2, 0, prompt[:-1])])
    if pad == "linear_rows":
        if _onednn_rows_are_invariant(decoder.config):
            pytest.skip("this CPU's oneDNN gives a row alone the bits it gets beside another "
                        "(checked on the model's linear shapes): the padding has nothing to show here")
        alone = fwd([(0, 40, [7])])[0]
        beside = fwd([(0, 40, [7]), (1, 40, [7])])
        assert torch.equal(beside[0], beside[1])
        assert not torch.equal(alone, beside[0])
    else:
        assert not torch.equal(whole, fwd([(2, 39, prompt[-1:])])[0])


def _onednn_rows_are_invariant(config) -> bool:
    """Whether oneDNN's bfloat16 linear gives one row the same bits alone as beside a second,
    for each linear shape of the model. It differs by CPU (its small-M kernels do): where it
    does not differ, the padding rows the test above removes change nothing."""
    from mashbox.model.linear import OneDNNLinear

    g = torch.Generator().manual_seed(0)
    h, q, kv, ffn = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    for n, k in ((q + 2 * kv, h), (h, q), (2 * ffn, h), (h, ffn), (config.vocab_size, h)):
        lin = OneDNNLinear((torch.randn(n, k, generator=g) * 0.05).bfloat16())
        x = torch.randn(2, k, generator=g).bfloat16()
        if not torch.equal(lin(x[:1])[0], lin(x)[0]):
            return False
    return True


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("multiple", [4, 8])
def test_padded_queries_keep_every_sdpa_query_block_full_enough(group, multiple):
    for n in range(1, 300):
        padded = _padded_queries(n, group, multiple)
        rows = group * padded
        assert padded >= n and rows >= multiple
        for block in (32, 64, 128, 256):  # SDPA's query blocks on CPU
            tail = rows % block if rows > block else rows
            assert tail == 0 or tail >= multiple, (n, padded, block)


@NO_ONEDNN_BF16
def test_packed_bfloat16_linears_give_the_plain_ones_bits(tmp_path, monkeypatch):
    """bf16 on a CPU without AVX512-BF16 runs linears on oneDNN-packed weights (for
    speed): same logits, bit for bit, as F.linear on the plain weights."""
    import mashbox.model.decoder as decoder_mod

    folder = str(make_tiny(tmp_path, "qwen2"))  # tied head, q/k/v biases
    packed = _decoder(folder, torch.bfloat16, Kernels(linears="onednn"))
    if not packed._packed:
        pytest.skip("this torch has no oneDNN linear packing")
    monkeypatch.setattr(decoder_mod, "_packs_linears", lambda device, dtype: False)
    plain = _decoder(folder, torch.bfloat16)
    assert not plain._packed
    prompt = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    outs = []
    for decoder in (packed, plain):
        cache = KVCache(decoder.config, slots=2, ctx=64, dtype=torch.bfloat16, device=CPU)
        first = decoder.forward(Batch.build([(0, 0, prompt), (1, 0, prompt[:9])]), cache)
        outs.append(torch.cat([first, decoder.forward(Batch.build([(0, 30, [3])]), cache)]))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_are_batch_invariant_and_close_to_dense(tmp_path, weights):
    """The opt-in weight-only formats keep every schedule's logits identical, and stay
    near the dense logits (random weights: int4 per group of 32 is coarse)."""
    folder = str(make_tiny(tmp_path, "qwen2"))  # tied head, q/k/v biases
    weights_ = loader.load(folder, torch.bfloat16, CPU)
    decoder = Decoder(weights_.config, weights_.tensors, torch.bfloat16, CPU, weights=weights)
    if not decoder._packed:
        pytest.skip("this torch has no oneDNN linear packing")
    prompt = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_schedules(decoder, prompt, ctx=64, vocab=128)
    dense = _decoder(folder, torch.bfloat16)
    got, want = [d.forward(Batch.build([(0, 0, prompt)]),
                           KVCache(d.config, slots=1, ctx=64, dtype=torch.bfloat16, device=CPU))[0]
                 for d in (decoder, dense)]
    assert not torch.equal(got, want), "the quantized weights are in use"
    # measured: int8 0.03, int4 0.38 (random weights; on Q4_1 GGUF weights int4 is near exact)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < {"int8": 0.06, "int4": 0.6}[weights], rel


def test_unknown_weight_format_is_a_model_error(tmp_path):
    from mashbox.model.errors import ModelError

    weights = loader.load(str(make_tiny(tmp_path, "llama")), torch.float32, CPU)
    with pytest.raises(ModelError, match="weights"):
        Decoder(weights.config, weights.tensors, torch.float32, CPU, weights="int3")
    with pytest.raises(ModelError, match="bfloat16"):
        Decoder(weights.config, weights.tensors, torch.float32, CPU, weights="int4")


@pytest.mark.slow
def test_int4_requantizes_the_default_models_q4_1_weights_almost_exactly(default_model_path):
    """Q4_1 is 4 bits per group of 32 with a scale and a minimum: the int4 format holds
    the same grid (only scale and minimum rounded to bf16), so logits stay near dense."""
    prompt = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(6)).tolist()
    out = {}
    for fmt in ("dense", "int4"):
        w = loader.load(default_model_path, torch.bfloat16, CPU)
        d = Decoder(w.config, w.tensors, torch.bfloat16, CPU, weights=fmt)
        out[fmt] = d.forward(Batch.build([(0, 0, prompt)]), KVCache(d.config, 1, 64, torch.bfloat16, CPU))[0]
    rel = ((out["int4"] - out["dense"]).norm() / out["dense"].norm()).item()
    assert rel < 0.02, rel  # measured 0.007


@pytest.mark.parametrize("decode", [False, True], ids=["prompt-rows", "decode-rows"])
@pytest.mark.parametrize("dtype,kernels", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("variant", ["llama", "mistral_window"])
def test_decode_rows_attend_alike_in_any_company(tmp_path, variant, dtype, kernels, decode):
    """One-token rows attend in one SDPA call per key width, over a view of their slot
    range or gathered slots (prompt rows: a prompt's last token recomputed), or on csrc's
    decode attention (decode rows, bfloat16 where it runs): a row's logits equal its own
    alone whatever shares the call (a far slot: gathered; a gap in the range: a spare
    slot; a longer slot: another key width, another call)."""
    decoder = _decoder(str(make_tiny(tmp_path, variant)), dtype, kernels)
    cache = KVCache(decoder.config, slots=10, ctx=600, dtype=dtype, device=CPU)
    fwd = lambda rows: decoder.forward(Batch.build(rows, decode=tuple(decode and len(r[2]) == 1 for r in rows)), cache)  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    lens = {0: 30, 2: 30, 3: 200, 9: 30}
    prompts = {s: torch.randint(0, 128, (n,), generator=gen).tolist() for s, n in lens.items()}
    for s in (0, 2, 3, 9):
        fwd([(s, 0, prompts[s])])
    # slot 0's decode alone, then the same step again from copies of its history
    alone = fwd([(0, 30, [7])])[0]
    for company in ([(9, 30, [5])], [(2, 30, [5])], [(3, 200, [5]), (2, 30, [6])], [(3, 200, [5]), (9, 30, [4])]):
        cache.k[:, 1], cache.v[:, 1] = cache.k[:, 0], cache.v[:, 0]
        got = fwd([(1, 30, [7])] + company)[0]
        assert torch.equal(alone, got), company


@pytest.mark.parametrize("kernel", CSRC_KERNELS, ids=CSRC_KERNEL_IDS)
@pytest.mark.parametrize("variant", ["llama", "llama_mha", "mistral_window", "qwen3_tied", "qwen2"])
def test_decode_attention_is_as_close_to_float32_as_sdpa(tmp_path, variant, kernel):
    """bfloat16 decode rows on csrc's attention against the same rows on SDPA
    (kernels.attention "sdpa"): against a float32 decoder, over 12 decode steps after a
    70-token prompt (past mistral_window's 8-key window), neither is further off than
    bfloat16's own noise."""
    path = str(make_tiny(tmp_path, variant))
    own = _decoder(path, torch.bfloat16, Kernels(kernel=kernel))
    weights = loader.load(path, torch.bfloat16, CPU)
    sdpa = Decoder(weights.config, weights.tensors, torch.bfloat16, CPU,
                   kernels=Kernels(attention="sdpa", kernel=kernel))
    exact = _decoder(path, torch.float32)
    assert own.kernels.attention == "csrc"
    assert sdpa.kernels.attention == "sdpa" and exact.kernels.attention == "sdpa"
    prompt = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(8)).tolist()
    errors = {}
    for name, d in (("own", own), ("sdpa", sdpa), ("f32", exact)):
        cache = KVCache(d.config, slots=2, ctx=128, dtype=d.dtype, device=CPU)
        d.forward(Batch.build([(1, 0, prompt)]), cache)
        steps = []
        for i, tok in enumerate([5, 17, 99, 3, 64, 2, 80, 11, 42, 7, 120, 33]):
            steps.append(d.forward(Batch.build([(1, 70 + i, [tok])], decode=(True,)), cache)[0])
        errors[name] = torch.stack(steps)
    scale = errors["f32"].abs().max().item()
    own_err = (errors["own"] - errors["f32"]).abs().max().item()
    sdpa_err = (errors["sdpa"] - errors["f32"]).abs().max().item()
    assert own_err <= 2 * sdpa_err + 0.01 * scale, (own_err, sdpa_err, scale)
    assert not torch.equal(errors["own"], errors["sdpa"]), "the two paths are not the same code"


@pytest.mark.parametrize("kernel", CSRC_KERNELS, ids=CSRC_KERNEL_IDS)
@pytest.mark.parametrize("variant", ["llama", "llama_mha", "mistral_window", "qwen2", "qwen3_tied"])
def test_decode_layers_in_one_c_call_give_the_python_paths_bits(tmp_path, variant, kernel):
    """A step of decode rows only runs its layers in one csrc call (csrc/layers.c); the
    same step through forward's Python loop (kernels.layers "python") gives the same logits and
    K/V, alone and at batch 3, with biases (qwen2), a window (mistral_window) and tied
    embeddings. Models with q/k norms (qwen3) keep the Python loop."""
    path = str(make_tiny(tmp_path, variant))
    in_c = _decoder(path, torch.bfloat16, Kernels(kernel=kernel))
    weights = loader.load(path, torch.bfloat16, CPU)
    in_py = Decoder(weights.config, weights.tensors, torch.bfloat16, CPU,
                    kernels=Kernels(layers="python", kernel=kernel))
    if variant == "qwen3_tied":
        assert in_c.kernels.layers == "python"
        return
    assert in_c.kernels.layers == "c"
    assert in_py.kernels.layers == "python"
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (40, 12, 70)]
    outs, caches = [], []
    for d in (in_c, in_py):
        cache = KVCache(d.config, slots=3, ctx=128, dtype=torch.bfloat16, device=CPU)
        for s, p in enumerate(prompts):
            d.forward(Batch.build([(s, 0, p)]), cache)
        steps = [d.forward(Batch.build([(0, 40, [3])], decode=(True,)), cache)]
        for i in range(4):
            rows = [(2, 70 + i, [9 + i]), (0, 41 + i, [5]), (1, 12 + i, [100 - i])]
            steps.append(d.forward(Batch.build(rows, decode=(True,) * 3), cache))
        outs.append(torch.cat(steps))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize("dtype,kernels", [KERNELS[0], KERNELS[2]], ids=["bf16-auto", "bf16-sdpa"])
def test_attention_index_and_masks_are_made_once(tmp_path, dtype, kernels):
    """After a first step of a shape, later steps of that shape or smaller fill the
    decoder's RowIndex and MaskArena in place: the same buffers, no new tensors."""
    decoder = _decoder(str(make_tiny(tmp_path, "mistral_window")), dtype, kernels)
    cache = KVCache(decoder.config, slots=4, ctx=200, dtype=dtype, device=CPU)
    gen = torch.Generator().manual_seed(3)
    prompt = lambda n: torch.randint(0, 128, (n,), generator=gen).tolist()  # noqa: E731
    steps = [[(0, 0, prompt(40)), (1, 0, prompt(30))], [(0, 40, [3]), (1, 30, prompt(20)), (2, 0, prompt(9))],
             [(0, 41, [5]), (1, 50, [6]), (2, 9, [7])]]
    decode = lambda rows: tuple(len(r[2]) == 1 for r in rows)  # noqa: E731

    def buffers():
        m = decoder._masks
        return [decoder._row_index._buf.data_ptr()] + [b.data_ptr() for b in (m._add.buf, m._bad, m._side, m._ints.buf, m._pos, m._q.buf)]

    for rows in steps:
        decoder.forward(Batch.build(rows, decode=decode(rows)), cache)
    made = buffers()
    for rows in steps + [[(3, 0, prompt(12))]]:
        decoder.forward(Batch.build(rows, decode=decode(rows)), cache)
        assert buffers() == made, rows
    # on SDPA the one-token rows' padded queries are the arena's too
    # SDPA's padded masks exist where attention runs on SDPA (forced, or auto on a CPU without AVX512-BF16)
    assert (decoder._masks._q.buf.numel() > 0) == (decoder.kernels.attention == "sdpa")

"""weights "gguf": a GGUF's linears kept in the file's quantized blocks (QuantLinear on
csrc/quant.c) instead of dequantized to bfloat16. On tiny random models written as GGUF
files: the loader hands blocks over, the decoder runs every linear on them, logits stay
batch invariant (every schedule of decoder_invariance) and near the dense decoder's on
the same file; block types csrc does not read yet (K-quants, until csrc/kquant.c is built
in) load dequantized, as before. The default model: test_quant_default_model.py."""
from __future__ import annotations

import gguf
import pytest
import torch
from test_decoder_invariance import _check_schedules
from test_model_gguf import _write_gguf
from tiny import make_tiny, reference

from mashbox import native
from mashbox.model import block_weight, linear, loader
from mashbox.model.decoder import Batch, Decoder
from mashbox.model.errors import ModelError
from mashbox.model.kernels import Kernels
from mashbox.model.kv_cache import KVCache

CPU = torch.device("cpu")
KERNELS, KERNEL_IDS = map(list, zip(*[(native.KERNEL_PORTABLE, "portable")]
                                     + ([(native.KERNEL_AVX512BF16, "avx512bf16")] if linear.bf16_kernel_available() else [])
                                     + ([(native.KERNEL_AVX2, "avx2")] if native.avx2_supported() else [])))
Q = gguf.GGMLQuantizationType


def _gguf(tmp_path, variant: str, qtype) -> str:
    path = str(tmp_path / f"{variant}-{qtype.name}.gguf")
    _write_gguf(reference(make_tiny(tmp_path, variant)), "llama" if variant.startswith("llama") else "qwen2",
                path, qtype)
    return path


def _decoders(path: str, kernel: int) -> tuple[Decoder, Decoder]:
    """(blocks, dense) decoders of one file, bfloat16."""
    w = loader.load(path, torch.bfloat16, CPU, blocks=True)
    quant = Decoder(w.config, w.tensors, torch.bfloat16, CPU, weights="gguf", kernels=Kernels(kernel=kernel))
    w = loader.load(path, torch.bfloat16, CPU)
    dense = Decoder(w.config, w.tensors, torch.bfloat16, CPU, kernels=Kernels(kernel=kernel))
    return quant, dense


def _last_logits(decoder: Decoder, ids: list[int]) -> torch.Tensor:
    cache = KVCache(decoder.config, slots=1, ctx=64, dtype=torch.bfloat16, device=CPU)
    return decoder(Batch.build([(0, 0, ids)]), cache)[0]


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("variant, qtype", [("llama_tied", Q.Q4_1), ("llama", Q.Q8_0), ("qwen2", Q.Q4_0),
                                            ("qwen2", Q.Q5_0), ("llama", Q.Q5_1)])
def test_blocks_run_every_linear_batch_invariant_near_dense(tmp_path, variant, qtype, kernel):
    path = _gguf(tmp_path, variant, qtype)
    quant, dense = _decoders(path, kernel)
    for layer in quant.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(w, linear.QuantLinear) and w.qtype == int(qtype)
    assert isinstance(quant.lm_head, linear.QuantLinear)
    assert quant.embed is None or isinstance(quant.embed, block_weight.BlockWeight)  # rows on lookup
    vocab = quant.config.vocab_size
    prompt = torch.randint(0, vocab, (19,), generator=torch.Generator().manual_seed(7)).tolist()
    _check_schedules(quant, prompt, 64, vocab)
    got, want = _last_logits(quant, prompt), _last_logits(dense, prompt)
    assert not torch.equal(got, want), "the blocks are in use, not the dense weights"
    # the same weights, other roundings (dense rounds each weight to bfloat16)
    assert (got - want).abs().max() < 0.05 * want.abs().max() + 0.05


def test_k_quant_tensors_load_dequantized_until_their_kernel_is_built_in(tmp_path):
    w = loader.load(_gguf(tmp_path, "llama", Q.Q8_0), torch.bfloat16, CPU, blocks=True)
    assert all(isinstance(t, block_weight.BlockWeight) for t in w.tensors.values() if len(t.shape) == 2)
    # a file whose types the kernels do not read: the same tensors, dense (what the K-quants
    # get while block_weight.KERNEL_TYPES lacks them)
    w16 = loader.load(_gguf(tmp_path, "llama", Q.F16), torch.bfloat16, CPU, blocks=True)
    assert not any(isinstance(t, block_weight.BlockWeight) for t in w16.tensors.values())
    decoder = Decoder(w16.config, w16.tensors, torch.bfloat16, CPU, weights="gguf")
    assert isinstance(decoder.layers[0].qkv, linear.BF16Linear)
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        assert (name in block_weight.KERNEL_TYPES) == native.q_supported(block_weight.GGML_TYPES[name])


def _with_v_in(tmp_path, qtype, layer: int = 0):
    """The llama Q8_0 tiny file's tensors with layer `layer`'s v_proj requantized to qtype."""
    w = loader.load(_gguf(tmp_path, "llama", Q.Q8_0), torch.bfloat16, CPU, blocks=True)
    name = f"model.layers.{layer}.self_attn.v_proj.weight"
    v = w.tensors[name]
    raw = gguf.quants.quantize(v.dequantize(torch.float32, CPU).numpy(), qtype)
    w.tensors[name] = block_weight.BlockWeight(qtype.name, torch.from_numpy(raw), v.shape)
    return w


def test_a_v_of_another_type_stays_in_blocks_beside_q_and_k(tmp_path):
    """q|k|v with v in another block type than q and k (as Q4_K_M files hold it): q|k and
    v stay blocks, two linears writing one y (QkvSplit), equal to the three parts run
    apart; the rest stays fused."""
    w = _with_v_in(tmp_path, Q.Q4_1)
    decoder = Decoder(w.config, w.tensors, torch.bfloat16, CPU, weights="gguf")
    split = decoder.layers[0].qkv
    assert isinstance(split, linear.QkvSplit)
    assert split.qk.qtype == int(Q.Q8_0) and split.v.qtype == int(Q.Q4_1)
    assert isinstance(decoder.layers[1].qkv, linear.QuantLinear)
    assert isinstance(decoder.layers[0].gate_up, linear.QuantLinear)
    x = torch.randn(5, w.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(split(x), torch.cat([split.qk(x), split.v(x)], dim=1))
    y = torch.randn(5, split.n, generator=torch.Generator().manual_seed(4)).bfloat16()
    split.qk.add_into(x, qk_y := y[:, :split.qk.n].contiguous())
    split.v.add_into(x, v_y := y[:, split.qk.n:].contiguous())
    split.add_into(x, y)
    assert torch.equal(y, torch.cat([qk_y, v_y], dim=1))
    # near the dense decoder of the same weights
    w = _with_v_in(tmp_path, Q.Q4_1)
    dense = Decoder(w.config, {k: t.dequantize(torch.bfloat16, CPU) if isinstance(t, block_weight.BlockWeight) else t
                               for k, t in w.tensors.items()}, torch.bfloat16, CPU)
    prompt = [3, 5, 7, 11, 13, 17]
    got, want = _last_logits(decoder, prompt), _last_logits(dense, prompt)
    assert (got - want).abs().max() < 0.05 * want.abs().max() + 0.05


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("v_apart", [False, True], ids=["one-type", "v-apart"])
def test_c_layer_loop_on_blocks_equals_the_python_loop(tmp_path, kernel, v_apart):
    """Decode steps on blocks run every layer in one C call (csrc/layers.c, the linears'
    *_type, and mb_layer's v where v has a type of its own): the same bits as
    PythonLayers' calls one by one."""
    path = _gguf(tmp_path, "llama", Q.Q4_1)
    decoders = []
    for layers in ("c", "python"):
        w = _with_v_in(tmp_path, Q.Q4_1) if v_apart else loader.load(path, torch.bfloat16, CPU, blocks=True)
        decoders.append(Decoder(w.config, w.tensors, torch.bfloat16, CPU, weights="gguf",
                                kernels=Kernels(kernel=kernel, attention="csrc", layers=layers)))
    assert decoders[0].kernels.layers == "c" and decoders[1].kernels.layers == "python"
    assert isinstance(decoders[0].layers[0].qkv, linear.QkvSplit) == v_apart
    outs = []
    for d in decoders:
        cache = KVCache(d.config, slots=3, ctx=64, dtype=torch.bfloat16, device=CPU)
        d(Batch.build([(s, 0, [3 + s, 5, 7, 11]) for s in range(3)]), cache)
        steps = [d(Batch.build([(s, 4 + i, [13 + i + s]) for s in range(3)], decode=(True,) * 3), cache)
                 for i in range(3)]
        outs.append(torch.stack(steps))
    assert torch.equal(outs[0], outs[1])


PROMPT_RULES = {  # rule -> (runs here, its kernel on arrays)
    "amx": (native.amx_supported() and linear.bf16_kernel_available(), native.q_linear_tiles),
    # beside the AVX512-BF16 decode kernel, or the AVX2 one (the lanes' AVX2 path)
    "lanes": (native.lanes_supported() and native.NATIVE and native.blocks_kernel_runs(), native.q_linear_lanes),
}


@pytest.mark.parametrize("rule", [pytest.param(r, marks=pytest.mark.skipif(not PROMPT_RULES[r][0],
                                                                          reason=f"prompt rule {r} cannot run here"))
                                  for r in PROMPT_RULES])
@pytest.mark.parametrize("v_apart", [False, True], ids=["one-type", "v-apart"])
def test_prompt_rows_on_their_rule_keep_every_schedule_invariant(tmp_path, v_apart, rule):
    """Kernels.prompt_linears "amx" / "lanes": prompt rows take the tile rule (csrc/amx.c)
    or the lanes rule (csrc/lanes.c), decode rows the vdpbf16ps one, so a prompt token's
    bits do not depend on its chunking nor a decode row's on its company (every schedule
    of decoder_invariance, QkvSplit's two parts included), and the logits stay near those
    of the decoder that runs every row on the vdpbf16ps kernel. "auto" takes amx where it
    runs, else lanes."""
    made = {}
    for name in (rule, "same", "auto"):
        w = _with_v_in(tmp_path, Q.Q4_1) if v_apart else loader.load(_gguf(tmp_path, "llama", Q.Q8_0),
                                                                      torch.bfloat16, CPU, blocks=True)
        made[name] = Decoder(w.config, w.tensors, torch.bfloat16, CPU, weights="gguf",
                             kernels=Kernels(prompt_linears=name))
    assert made["auto"].kernels.prompt_linears == ("amx" if PROMPT_RULES["amx"][0] else "lanes")
    ruled, same = made[rule], made["same"]
    assert ruled.kernels.prompt_linears == rule and same.kernels.prompt_linears == "same"
    qkv = ruled.layers[0].qkv
    assert all(p.prompt_kernel is not None for p in ((qkv.qk, qkv.v) if v_apart else (qkv,)))
    vocab = ruled.config.vocab_size
    prompt = torch.randint(0, vocab, (37,), generator=torch.Generator().manual_seed(11)).tolist()
    _check_schedules(ruled, prompt, 64, vocab)
    got, want = _last_logits(ruled, prompt), _last_logits(same, prompt)
    assert (got - want).abs().max() < 0.02 * want.abs().max() + 0.02
    # each row by its kind's rule: the prompt runs' rows by the prompt rule, the others not
    x = torch.randn(9, ruled.config.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    up = ruled.layers[0].gate_up
    bits, blocks = x.view(torch.int16).numpy().view("uint16"), up.blocks.numpy()
    by = {True: PROMPT_RULES[rule][1](up.qtype, blocks, bits, y_f32=True),
          False: native.q_linear(up.qtype, blocks, bits, y_f32=True)}
    assert not torch.equal(torch.from_numpy(by[True]), torch.from_numpy(by[False])), "two rules"
    for runs in (((2, 7),), ((0, 2), (4, 9)), ((3, 4), (5, 6)), ((0, 9),)):
        y = up(x, torch.float32, prompt=runs)
        for r in range(9):
            assert torch.equal(y[r], torch.from_numpy(by[any(t0 <= r < t1 for t0, t1 in runs)][r])), (runs, r)
    for bad in (((3, 2),), ((0, 4), (2, 6)), ((5, 10),), ((4, 4),)):
        with pytest.raises(ValueError, match="prompt runs must be ordered"):
            up(x, torch.float32, prompt=bad)


def test_prompt_rules_need_gguf_blocks_and_their_cpu(tmp_path):
    """An explicit prompt_linears "amx" or "lanes" that cannot run is refused, not quietly
    dropped."""
    w = loader.load(_gguf(tmp_path, "llama", Q.Q8_0), torch.bfloat16, CPU)
    for rule in PROMPT_RULES:
        with pytest.raises(ModelError, match=f"prompt_linears {rule}"):
            Decoder(w.config, w.tensors, torch.bfloat16, CPU, weights="dense", kernels=Kernels(prompt_linears=rule))
    with pytest.raises(ModelError, match="prompt_linears must be one of"):
        Kernels(prompt_linears="tiles")


@pytest.mark.skipif(not (native.NATIVE and native.bf16_kernel() == native.KERNEL_AVX2),
                    reason="the fastest kernel here is not the AVX2 one")
def test_gguf_on_the_avx2_kernel_takes_csrc_decode_attention_and_the_lanes(tmp_path):
    """Where AVX2 is the fastest kernel (torch's bfloat16 emulated), GGUF blocks' auto
    kernels: decode rows on csrc's attention in the C layer loop, prompt rows' attention on
    SDPA (the prefill kernel has no AVX2 path), prompt rows' linears on the lanes' AVX2
    path; dense weights keep SDPA and the Python loop."""
    w = loader.load(_gguf(tmp_path, "llama", Q.Q4_1), torch.bfloat16, CPU, blocks=True)
    d = Decoder(w.config, w.tensors, torch.bfloat16, CPU, weights="gguf")
    k = d.kernels
    assert (k.linears, k.attention, k.layers, k.prefill, k.prompt_linears, k.kernel) == \
        ("csrc", "csrc", "c", "sdpa", "lanes", native.KERNEL_AVX2)
    dense = loader.load(_gguf(tmp_path, "llama", Q.Q4_1), torch.bfloat16, CPU)
    kd = Decoder(dense.config, dense.tensors, torch.bfloat16, CPU, weights="dense").kernels
    assert (kd.attention, kd.layers) == ("sdpa", "python")

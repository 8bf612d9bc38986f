"""model/csrc.py, where tensors become addresses: a wrong tensor is a ValueError naming
the argument before anything reaches C; model/kernels.py: a choice is made once and an
impossible one is refused; csrc's portable kernel and its AVX512-BF16 one give a decoder
the same bits."""
from __future__ import annotations

import pytest
import torch
from tiny import make_tiny

from mashbox import native
from mashbox.model import csrc, linear, loader
from mashbox.model.decoder import Batch, Decoder
from mashbox.model.errors import ModelError
from mashbox.model.kernels import Kernels
from mashbox.model.kv_cache import KVCache

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def test_a_linear_checks_x_weight_bias_and_y():
    lin = linear.BF16Linear(torch.randn(5, 8).to(BF16), torch.randn(5), kernel=native.KERNEL_PORTABLE)
    with pytest.raises(ValueError, match=r"^x must .*\[rows, 8\]"):
        lin(torch.zeros(2, 6, dtype=BF16))  # too narrow: C would read past each row
    y = torch.empty(2, 5, dtype=BF16)
    with pytest.raises(ValueError, match="^packed must"):
        csrc.linear(torch.zeros(2, 8, dtype=BF16), lin.packed[:-1], 5, 8, None, y, native.Y_BF16, lin.kernel)
    with pytest.raises(ValueError, match="^bias must"):
        csrc.linear(torch.zeros(2, 8, dtype=BF16), lin.packed, 5, 8, torch.zeros(5, dtype=BF16), y,
                    native.Y_BF16, lin.kernel)
    with pytest.raises(ValueError, match="^y must"):
        csrc.linear(torch.zeros(2, 8, dtype=BF16), lin.packed, 5, 8, None, y, native.Y_F32, lin.kernel)
    with pytest.raises(ValueError, match="^y must have 2 rows"):
        csrc.linear(torch.zeros(2, 8, dtype=BF16), lin.packed, 5, 8, None, y[:1], native.Y_BF16, lin.kernel)


def test_rope_kv_and_attention_check_their_index_tensors():
    qkv = torch.zeros(2, 4 * 16, dtype=BF16)
    table = torch.zeros(32, 16, dtype=BF16)
    cache = torch.zeros(2, 1, 32, 16, dtype=BF16)
    good = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="^positions must .*int64"):
        csrc.rope_kv(qkv, 2, 2, 1, table, table, good.to(torch.int32), good, cache, cache.clone())
    with pytest.raises(ValueError, match=r"^slots must .*\[2\]"):
        csrc.rope_kv(qkv, 2, 2, 1, table, table, good, good[:1], cache, cache.clone())
    with pytest.raises(ValueError, match="^v_cache must"):
        csrc.rope_kv(qkv, 2, 2, 1, table, table, good, good, cache, cache.transpose(2, 3).contiguous())
    out = torch.zeros(2, 32, dtype=BF16)
    with pytest.raises(ValueError, match="^ends must"):
        csrc.attention(qkv, good, good, good.to(torch.int32) + 1, 2, 1, 0, 0.25, cache, cache, out,
                       native.KERNEL_PORTABLE)
    with pytest.raises(ValueError, match="^out must"):
        csrc.attention(qkv, good, good, good + 1, 2, 1, 0, 0.25, cache, cache, out.float(), native.KERNEL_PORTABLE)


def test_a_layer_table_checks_every_tensor_it_will_own():
    hidden, heads, kv_heads, d, inter = 16, 2, 1, 16, 8
    packed = lambda n, k: torch.zeros(csrc.packed_bytes(n, k) // 2, dtype=torch.int16)  # noqa: E731
    layer = dict(input_norm=torch.ones(hidden, dtype=BF16), post_norm=torch.ones(hidden, dtype=BF16),
                 qkv=packed((heads + 2 * kv_heads) * d, hidden), o=packed(hidden, heads * d),
                 gate_up=packed(2 * inter, hidden), down=packed(hidden, inter), qkv_bias=None, o_bias=None)
    csrc.LayerTable([layer], hidden, heads, kv_heads, d, inter)
    for name, bad in (("input_norm", torch.ones(hidden)), ("down", packed(hidden, inter - 2)),
                      ("o_bias", torch.zeros(hidden - 1))):
        with pytest.raises(ValueError, match=rf"^layers\[1\]\.{name}"):
            csrc.LayerTable([layer, dict(layer, **{name: bad})], hidden, heads, kv_heads, d, inter)


def test_kernels_are_checked_and_impossible_choices_refused(tmp_path):
    with pytest.raises(ModelError, match="kernels.linears"):
        Kernels(linears="mkl")
    with pytest.raises(ModelError, match="kernels.kernel"):
        Kernels(kernel=7)
    w = loader.load(str(make_tiny(tmp_path, "qwen3_tied")), torch.float32, CPU)
    for bad in (Kernels(linears="csrc"), Kernels(attention="csrc"), Kernels(layers="c")):
        with pytest.raises(ModelError, match="kernels"):
            Decoder(w.config, dict(w.tensors), torch.float32, CPU, kernels=bad)
    w = loader.load(str(make_tiny(tmp_path, "qwen3_tied")), BF16, CPU)
    with pytest.raises(ModelError, match="q/k norms"):  # qwen3's layers keep the Python loop
        Decoder(w.config, w.tensors, BF16, CPU, kernels=Kernels(layers="c", kernel=native.KERNEL_PORTABLE))


def test_prompt_rows_take_sdpa_on_amx_and_csrc_elsewhere(tmp_path):
    """kernels.prefill "auto": SDPA where the CPU has AMX-BF16 tiles (oneDNN's gemms use
    them), csrc's prefill kernel elsewhere; an explicit csrc that cannot run is refused."""
    if not native.NATIVE:
        pytest.skip("the C extension is not built")
    c = loader.load(str(make_tiny(tmp_path, "llama")), BF16, CPU).config
    auto = Kernels(kernel=native.KERNEL_PORTABLE)
    assert auto.resolve(c, BF16, CPU, "dense", True, amx=False).prefill == "csrc"
    assert auto.resolve(c, BF16, CPU, "dense", True, amx=True).prefill == "sdpa"
    assert Kernels(kernel=native.KERNEL_PORTABLE, prefill="csrc").resolve(c, BF16, CPU, "dense", True,
                                                                       amx=True).prefill == "csrc"
    assert Kernels(attention="sdpa").resolve(c, BF16, CPU, "dense", True).prefill == "sdpa"
    with pytest.raises(ModelError, match="kernels.prefill csrc"):
        Kernels(attention="sdpa", prefill="csrc").resolve(c, BF16, CPU, "dense", True)
    with pytest.raises(ModelError, match="kernels.prefill"):
        Kernels(prefill="flash")


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral_window"])
def test_the_portable_kernel_gives_the_avx512_kernels_bits(tmp_path, variant):
    """The portable kernel (what a CPU without AVX512-BF16 runs when forced) and the
    AVX512-BF16 one: the same logits and K/V over a prefill and decode steps."""
    if not linear.bf16_kernel_available():
        pytest.skip("no AVX512-BF16 here: the portable kernel is the only one (tested everywhere else)")
    path = str(make_tiny(tmp_path, variant))
    outs = []
    for kernel in (native.KERNEL_PORTABLE, native.KERNEL_AVX512BF16):
        w = loader.load(path, BF16, CPU)
        # prompt rows on csrc's prefill kernel too, even where "auto" would take SDPA (AMX)
        d = Decoder(w.config, w.tensors, BF16, CPU, kernels=Kernels(kernel=kernel, prefill="csrc"))
        assert d.kernels == Kernels("csrc", "csrc", "c", kernel, "csrc", "same")
        cache = KVCache(d.config, slots=2, ctx=128, dtype=BF16, device=CPU)
        prompt = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(2)).tolist()
        steps = [d.forward(Batch.build([(0, 0, prompt), (1, 0, prompt[:20])]), cache)]
        for i in range(3):
            steps.append(d.forward(Batch.build([(0, 50 + i, [3 + i]), (1, 20 + i, [9])], decode=(True, True)), cache))
        outs.append((torch.cat(steps), cache.k, cache.v))
    for a, b in zip(*outs):
        assert torch.equal(a, b)

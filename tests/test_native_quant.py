"""GGUF block linears (csrc/quant.c): the C kernels against native_ref.q_linear (itself
built on gguf-py's dequantization), and what the decoder relies on (a row's bits never
depend on the rest of its batch or the threads that run it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mashbox import native, native_ref
from mashbox.model import device, linear
from mashbox.model.block_weight import GGML_TYPES, BlockWeight

gguf = pytest.importorskip("gguf")

# avx512bf16 widens Q8_0 through byte lookups where the CPU has AVX512-VBMI; avx512bf16-int32
# is what the CPUs without it run; the last is the fastest here
KERNELS, KERNEL_IDS = map(list, zip(*[(native.KERNEL_PORTABLE, "portable")]
                                     + ([(native.KERNEL_AVX512BF16_INT32, "avx512bf16-int32"),
                                         (native.KERNEL_AVX512BF16, "avx512bf16")]
                                        if linear.bf16_kernel_available() else [])
                                     + ([(native.KERNEL_AVX2, "avx2")] if native.avx2_supported() else [])))
TYPES = list(native.Q_LEGACY)
TYPE_IDS = [gguf.GGMLQuantizationType(t).name for t in TYPES]


def _same(a: np.ndarray, b: np.ndarray, y_f32: bool) -> bool:
    """Equal bits, +0 and -0 one (the rule leaves an underflow's zero sign open)."""
    u = a.view(np.uint32 if y_f32 else np.uint16)
    v = b.view(np.uint32 if y_f32 else np.uint16)
    sign = np.uint32(0x7FFFFFFF) if y_f32 else np.uint16(0x7FFF)
    return bool(np.all((u == v) | (((u & sign) == 0) & ((v & sign) == 0))))


def _blocks(draw, qtype: int, n: int, k: int) -> np.ndarray:
    """n rows of k elements in qtype's blocks: quantized from floats (what files hold), or
    raw bytes with finite, modest float16 scales (every bit pattern of the integers)."""
    if draw(st.booleans()):
        w = draw(hnp.arrays(np.float32, (n, k), elements=st.floats(-8, 8, width=32)))
        with np.errstate(all="ignore"):  # gguf-py divides by a zero block's scale
            return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    nbytes, m_at = native_ref.Q_FORMATS[qtype]
    raw = draw(hnp.arrays(np.uint8, (n, k // 32, nbytes)))
    scale = st.floats(-4, 4, width=16, allow_subnormal=True).map(lambda v: np.float16(v).view(np.uint16))
    d = draw(hnp.arrays(np.uint16, (n, k // 32), elements=scale))
    raw[:, :, 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    if m_at is not None:
        mn = draw(hnp.arrays(np.uint16, (n, k // 32), elements=scale))
        raw[:, :, m_at:m_at + 2] = mn.view(np.uint8).reshape(n, k // 32, 2)
    return raw.reshape(n, -1)


# bfloat16 activations: normal magnitudes in [2**-60, 2**40] (no product leaves float32's
# normal range), zeros, and denormals (read as zero)
_bits = st.builds(lambda sign, exp, mantissa: (sign << 15) | (exp << 7) | mantissa,
                  st.integers(0, 1), st.just(0) | st.integers(127 - 60, 127 + 40), st.integers(0, 127))


@st.composite
def _problem(draw, max_m=16, max_n=40, max_blocks=5):
    qtype = draw(st.sampled_from(TYPES))
    m, n, k = draw(st.integers(1, max_m)), draw(st.integers(1, max_n)), 32 * draw(st.integers(1, max_blocks))
    if draw(st.booleans()):
        x = native_ref.f32_to_bf16(draw(hnp.arrays(np.float32, (m, k), elements=st.floats(-1e3, 1e3, width=32))))
    else:
        x = draw(hnp.arrays(np.uint16, (m, k), elements=_bits))
    bias = draw(st.none() | hnp.arrays(np.float32, (n,), elements=st.floats(-1e3, 1e3, width=32)))
    mode = draw(st.sampled_from(["bf16", "f32", "add"]))
    add_to = native_ref.f32_to_bf16(np.float32(draw(st.floats(-10, 10))) + np.zeros((m, n), np.float32)) \
        if mode == "add" else None
    return qtype, _blocks(draw, qtype, n, k), x, bias, mode == "f32", add_to


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@settings(max_examples=80, deadline=None)
@given(_problem())
def test_kernels_match_the_reference(kernel, problem):
    qtype, w, x, bias, y_f32, add_to = problem
    want = native_ref.q_linear(qtype, w, x, bias, y_f32, add_to)
    got = native.q_linear(qtype, w, x, bias, y_f32, add_to, kernel=kernel)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert _same(got, want, y_f32)


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_reference_weights_are_gguf_py_dequantization(qtype):
    """q * d + m, the values the rule multiplies by, are gguf-py's own dequantized ones,
    and the result is close to a float64 product with them."""
    rng = np.random.default_rng(qtype)
    n, k = 37, 160
    w = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType(qtype))
    q, d, mn = native_ref.q_parts(qtype, w)
    values = (q * d[..., None] + (0 if mn is None else mn[..., None])).reshape(n, k)
    dense = gguf.quants.dequantize(w, gguf.GGMLQuantizationType(qtype))
    assert np.array_equal(values, dense)
    x = native_ref.f32_to_bf16(rng.standard_normal((5, k)).astype(np.float32))
    exact = native_ref.bf16_to_f32(x).astype(np.float64) @ dense.astype(np.float64).T
    got = native.q_linear(qtype, w, x, y_f32=True)
    assert np.allclose(got, exact, rtol=1e-5, atol=1e-4)


def _quant_linear(qtype: int, n: int, k: int, seed: int, kernel: int, bias: bool = True):
    rng = np.random.default_rng(seed)
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType(qtype))
    name = gguf.GGMLQuantizationType(qtype).name
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if bias else None
    return linear.QuantLinear(BlockWeight(name, torch.from_numpy(raw), (n, k)), b, kernel=kernel), raw


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_rows_do_not_depend_on_their_batch(kernel, qtype):
    """Row r of a batch of m equals the row alone (one row widens in registers, more sweep
    a scratch), for m across the 2- and 3-row sweeps and 256-row work items, odd n (a lone
    last output, a part-filled group of four), k past one 8-block scratch chunk, with the
    threads torch runs."""
    n, k, rows = 37, 320, 260
    lin, _ = _quant_linear(qtype, n, k, 0, kernel)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    alone = torch.cat([lin(x[r:r + 1]) for r in range(rows)])
    for m in (1, 2, 3, 4, 5, 7, 16, 17, 255, 256, 257, rows):
        for start in (0, rows - m):
            assert torch.equal(lin(x[start:start + m]), alone[start:start + m]), (m, start)
    assert torch.equal(lin(x, torch.float32).bfloat16(), alone)


def test_q8_0_widens_through_byte_lookups_where_the_cpu_has_vbmi():
    """What makes the avx512bf16 and avx512bf16-int32 runs above two kernels, not one."""
    flags = device.cpu_flags()
    if not flags:
        pytest.skip("the CPU's flags come from Linux's /proc/cpuinfo")
    state = native.q_vbmi_widening()
    if state < 0:
        pytest.skip("this build has no AVX512 path")
    assert state == int({"avx512vbmi", "avx512_bf16"} <= flags)


def test_q8_0_every_integer_widens_exactly():
    """Each of the 256 integers (-128 included: the lookups' one corner) in every position
    of a block, on each kernel: the reference's bits."""
    q = np.arange(-128, 128, dtype=np.int8).reshape(8, 32)
    rows = np.concatenate([np.roll(q, s, axis=1) for s in range(0, 32, 5)])  # [56, 32]
    rows = np.tile(rows, (1, 3))  # three blocks a row
    n = rows.shape[0]
    d = np.full((n, 3, 1), 0.5, np.float16).view(np.uint8)  # [n, 3, 2]
    w = np.concatenate([d, rows.reshape(n, 3, 32).view(np.uint8)], axis=2).reshape(n, 3 * 34)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)).bfloat16().view(torch.int16).numpy().view(np.uint16)
    ref = native_ref.q_linear(int(gguf.GGMLQuantizationType.Q8_0), w, x)
    for kernel in KERNELS:
        for m in (1, 5):
            got = native.q_linear(int(gguf.GGMLQuantizationType.Q8_0), w, x[:m], kernel=kernel)
            assert _same(got, ref[:m], False), kernel


def test_threads_and_kernels_give_the_same_bits():
    gen = torch.Generator().manual_seed(2)
    before = torch.get_num_threads()
    for qtype in TYPES:
        lins = [_quant_linear(qtype, 300, 256, 3, kernel)[0] for kernel in KERNELS]
        x = torch.randn(19, 256, generator=gen).bfloat16()
        outs = []
        try:
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs += [lin(x) for lin in lins]
        finally:
            torch.set_num_threads(before)
        assert all(torch.equal(outs[0], o) for o in outs[1:]), qtype


def test_add_into_strided_inputs_and_rows():
    lin, raw = _quant_linear(native.Q4_1, 64, 128, 4, KERNELS[-1], bias=False)
    wide = torch.randn(9, 200).bfloat16()
    x = wide[:, 10:138]  # rows 200 apart
    y = torch.randn(9, 64).bfloat16()
    want = native_ref.q_linear(native.Q4_1, raw, x.contiguous().view(torch.int16).numpy().view(np.uint16),
                               add_to=y.view(torch.int16).numpy().view(np.uint16))
    lin.add_into(x, y)
    assert np.array_equal(y.view(torch.int16).numpy().view(np.uint16), want)
    ids = torch.tensor([0, 63, 5, 5])
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)).bfloat16()
    assert torch.equal(lin.rows(ids), dense[ids])


def test_bad_shapes_are_refused_before_c():
    lin, _ = _quant_linear(native.Q8_0, 16, 64, 5, KERNELS[-1])
    with pytest.raises(ValueError, match="x must be"):
        lin(torch.zeros(2, 32).bfloat16())
    with pytest.raises(ValueError, match="add_into"):
        lin.add_into(torch.zeros(2, 64).bfloat16(), torch.zeros(2, 15).bfloat16())
    with pytest.raises(ValueError, match="w must be"):
        native.q_linear(native.Q8_0, np.zeros((4, 33), np.uint8), np.zeros((1, 32), np.uint16))
    assert native.q_row_bytes(native.Q4_0, 48) == 0 and native.q_row_bytes(native.Q4_0, 64) == 36
    assert set(GGML_TYPES) >= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}


def test_k_quants_go_through_the_dispatcher_to_their_kernel():
    """mb_q_linear runs every block type the loader keeps (block_weight.KERNEL_TYPES); the
    K-quants go to mb_kq_linear unchanged: the same bits as calling it directly."""
    from mashbox.model import block_weight

    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        assert native.q_supported(GGML_TYPES[name]) and name in block_weight.KERNEL_TYPES
    rng = np.random.default_rng(3)
    n, k, m = 5, 256, 3
    w = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    w[:, 0:4] = np.frombuffer(np.array([0.01, 0.002], dtype=np.float16).tobytes(), np.uint8)  # d, dmin
    x = (rng.standard_normal((m, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    outs = []
    for call in (native.q_linear_ptr, native.kq_linear_ptr):
        y = np.zeros((m, n), dtype=np.float32)
        call(native.Q4_K, w.ctypes.data, 144, n, k, x.ctypes.data, k, m, 0, y.ctypes.data, native.Y_F32, n,
             KERNELS[-1], 0, 1)
        outs.append(y)
    assert np.array_equal(outs[0], outs[1]) and np.isfinite(outs[0]).all()
"""Prompt rows of the GGUF linears by their own rules: the tile rule on AMX tiles
(csrc/amx.c) and the lanes rule on vdpbf16ps lanes (csrc/lanes.c; emulated by fused
multiply-adds on its AVX2 path). Each kernel against
its reference (native_ref.q_linear_tiles, q_linear_lanes) bit for bit on every block type
(the references built on gguf-py's dequantization), the parts against gguf's values, and
batch invariance (a row's bits never depend on m, its neighbours or the threads). A
rule's kernel tests skip on a CPU that cannot run it, where the decoder never takes it."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mashbox import native, native_ref
from test_native_kquant import _same, _x  # bfloat16 rows with zeros and denormals; bits, either zero

TYPES = [native.Q8_0, native.Q4_0, native.Q4_1, native.Q5_0, native.Q5_1, native.Q4_K, native.Q5_K, native.Q6_K]
TYPE_IDS = [gguf.GGMLQuantizationType(t).name for t in TYPES]
BLOCK = {t: 256 if t in native_ref.KQ_BLOCK_BYTES else 32 for t in TYPES}

# rule -> (the kernel on arrays, its reference, the kernel on addresses), each where it runs
RULES = {
    "tiles": (native.q_linear_tiles, native_ref.q_linear_tiles, native.q_linear_tiles_ptr),
    "lanes": (native.q_linear_lanes, native_ref.q_linear_lanes, native.q_linear_lanes_ptr),
}
RUNS = {"tiles": native.amx_supported(), "lanes": native.lanes_supported()}
rules = pytest.mark.parametrize("rule", [
    pytest.param("tiles", marks=pytest.mark.skipif(not RUNS["tiles"], reason="no AMX-BF16 tiles on this CPU (or OS)")),
    pytest.param("lanes", marks=pytest.mark.skipif(not RUNS["lanes"], reason="no AVX512-BF16 or AVX2 on this CPU")),
])


def _rows(rng: np.random.Generator, qtype: int, n: int, blocks: int) -> np.ndarray:
    """uint8[n, row bytes]: every bit pattern of the integers and scales, with the float16
    d (and m, dmin) of real models' sizes, a few of them subnormal."""
    size = native_ref.KQ_BLOCK_BYTES.get(qtype) or native_ref.Q_FORMATS[qtype][0]
    w = rng.integers(0, 256, (n, blocks, size), dtype=np.uint8)

    def half(shape, scale):
        return (rng.standard_normal(shape) * scale * 10.0 ** rng.integers(-6, 0, shape)).astype(np.float16) \
            .view(np.uint8).reshape(shape + (2,))

    d_at = 208 if qtype == native.Q6_K else 0
    w[..., d_at:d_at + 2] = half((n, blocks), 10)
    m_at = 2 if qtype in (native.Q4_K, native.Q5_K) else native_ref.Q_FORMATS.get(qtype, (0, None))[1]
    if m_at is not None:
        w[..., m_at:m_at + 2] = half((n, blocks), 10)
    return w.reshape(n, blocks * size)


@st.composite
def _problem(draw, types=tuple(TYPES)):
    qtype = draw(st.sampled_from(types))
    m, n = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    blocks = draw(st.integers(1, 3 if BLOCK[qtype] == 256 else 20))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bias = draw(st.none() | hnp.arrays(np.float32, (n,), elements=st.floats(-1e3, 1e3, width=32)))
    mode = draw(st.sampled_from(["bf16", "f32", "add"]))
    add_to = native_ref.f32_to_bf16(rng.standard_normal((m, n)).astype(np.float32)) if mode == "add" else None
    return qtype, _rows(rng, qtype, n, blocks), _x(rng, m, blocks * BLOCK[qtype]), bias, mode == "f32", add_to


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_parts_are_ggufs_dequantization(qtype):
    """q * scale + min, the parts the tile rule multiplies, is gguf's value exactly."""
    rng = np.random.default_rng(qtype)
    w = _rows(rng, qtype, 5, 3)
    q, scale, mins = native_ref.tile_parts(qtype, w)
    want = gguf.quants.dequantize(w, gguf.GGMLQuantizationType(qtype)).reshape(q.shape)
    got = q * scale[..., None] + (0 if mins is None else mins[..., None])
    assert np.array_equal(got, want)
    assert np.array_equal(q, np.round(q)) and np.abs(q).max() <= 128  # exact in bfloat16


@rules
@settings(max_examples=120, deadline=None)
@given(problem=_problem())
def test_kernel_matches_the_reference(rule, problem):
    kernel, ref, _ = RULES[rule]
    qtype, w, x, bias, y_f32, add_to = problem
    assert _same(kernel(qtype, w, x, bias, y_f32, add_to), ref(qtype, w, x, bias, y_f32, add_to))


@rules
def test_reference_order_is_the_hardwares(rule):
    """Sums that cancel (values of 2^-20 .. 2^20 in one sub-block) separate one order of
    the adds from another: the kernel and the reference agree on each, so the order the
    reference states is the one TDPBF16PS (or the vdpbf16ps chain) runs; the three rules
    differ from one another."""
    kernel, ref, _ = RULES[rule]
    rng = np.random.default_rng(7)
    x = native_ref.f32_to_bf16((rng.standard_normal((16, 64)) * 2.0 ** rng.integers(-20, 20, (16, 64)))
                               .astype(np.float32))
    w = _rows(rng, native.Q8_0, 16, 2)
    want = ref(native.Q8_0, w, x, y_f32=True)
    assert _same(kernel(native.Q8_0, w, x, y_f32=True), want)
    others = [native_ref.q_linear(native.Q8_0, w, x, y_f32=True)]  # the decode rows' vdpbf16ps rule
    others += [r(native.Q8_0, w, x, y_f32=True) for name, (_, r, _) in RULES.items() if name != rule]
    assert not any(_same(other, want) for other in others)


@rules
@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_rows_do_not_depend_on_their_batch(rule, qtype):
    """Each row alone, in any slice, and the whole batch on two threads: the same bits (the
    row tiles of 16 or blocks of 8 and the work items of 512 rows are where a dependence
    would show, and for the tiles runs of up to 16 rows take the other path, the weights
    as A tiles and x as B)."""
    kernel = RULES[rule][0]
    rng = np.random.default_rng(qtype + 100)
    k = 2 * BLOCK[qtype] if BLOCK[qtype] == 256 else 96
    w, x = _rows(rng, qtype, 37, k // BLOCK[qtype]), _x(rng, 600, k)
    from mashbox.model import csrc

    whole = kernel(qtype, w, x, y_f32=True, parallel=csrc.parallel(), threads=2)
    for lo, hi in ((0, 1), (5, 6), (3, 11), (20, 36), (36, 53), (17, 33), (250, 300), (0, 300), (509, 600)):
        assert _same(kernel(qtype, w, x[lo:hi], y_f32=True), whole[lo:hi])


@rules
def test_bad_shapes_are_refused_before_c(rule):
    kernel, _, ptr = RULES[rule]
    w = _rows(np.random.default_rng(0), native.Q4_K, 4, 1)
    with pytest.raises(ValueError, match="w must be"):
        kernel(native.Q4_K, w, np.zeros((2, 128), np.uint16))
    kernel_arg = (native.lanes_kernels()[0],) if rule == "lanes" else ()
    with pytest.raises(ValueError, match=f"q_linear_{rule}"):  # C's own check: ldx < k
        ptr(native.Q4_K, w.ctypes.data, w.shape[1], 4, 256, 0, 100, 2, 0, 0, 0, 4, *kernel_arg, 0, 1)


# The lanes' kernels that run here: on AVX512-BF16, KERNEL_AVX512BF16 takes Q8_0's byte
# lookups where the CPU has VBMI (native.q_vbmi_widening() == 1), KERNEL_AVX512BF16_INT32
# the widening every AVX512-BF16 CPU runs (csrc/widen.h's); KERNEL_AVX2 the AVX2 path
# (rows in the lanes, its own widening), on AVX-512 CPUs too; the same bits, the reference's
LANES_KERNELS = native.lanes_kernels()
KERNEL_IDS = {native.KERNEL_AVX512BF16: "avx512bf16", native.KERNEL_AVX512BF16_INT32: "int32",
              native.KERNEL_AVX2: "avx2"}
lanes_only = pytest.mark.skipif(not RUNS["lanes"], reason="no AVX512-BF16 or AVX2 on this CPU")
lanes_kernels = pytest.mark.parametrize("kernel", LANES_KERNELS, ids=[KERNEL_IDS[k] for k in LANES_KERNELS])


@lanes_only
@lanes_kernels
@settings(max_examples=60, deadline=None)
@given(problem=_problem())
def test_every_lanes_kernel_matches_the_reference(kernel, problem):
    """Each kernel the lanes take here, on every block type (the rule test above runs the
    fastest only)."""
    qtype, w, x, bias, y_f32, add_to = problem
    want = native_ref.q_linear_lanes(qtype, w, x, bias, y_f32, add_to)
    assert _same(native.q_linear_lanes(qtype, w, x, bias, y_f32, add_to, kernel=kernel), want)


@lanes_only
@lanes_kernels
@settings(max_examples=60, deadline=None)
@given(problem=_problem(types=(native.Q8_0,)))
def test_lanes_q8_0_routes_match_the_reference(kernel, problem):
    """Odd outputs (a group's last 16 or fewer, some repeated), 1-20 blocks (a chunk's
    end mid-chunk), 1-40 rows, every y mode."""
    qtype, w, x, bias, y_f32, add_to = problem
    want = native_ref.q_linear_lanes(qtype, w, x, bias, y_f32, add_to)
    assert _same(native.q_linear_lanes(qtype, w, x, bias, y_f32, add_to, kernel=kernel), want)


@lanes_only
def test_lanes_q8_0_every_integer_widens_exactly():
    """Each of the 256 integers (-128 included: the byte lookups' one corner) in every
    position of a block and every output of a group of 32 (the byte transpose's places),
    through both routes, on rows that fill two register blocks and one left over."""
    q = np.arange(-128, 128, dtype=np.int8).reshape(8, 32)
    rows = np.concatenate([np.roll(q, s, axis=1) for s in range(0, 32, 3)])  # [88, 32]: 2 groups and 24
    rows = np.concatenate([rows, np.roll(rows, 7, axis=0)], axis=1)  # two blocks a row, other neighbours
    n = rows.shape[0]
    d = np.random.default_rng(3).uniform(0.25, 4, (n, 2, 1)).astype(np.float16).view(np.uint8)  # [n, 2, 2]
    w = np.concatenate([d, rows.reshape(n, 2, 32).view(np.uint8)], axis=2).reshape(n, 2 * 34)
    x = _x(np.random.default_rng(4), 17, 64)
    want = native_ref.q_linear_lanes(native.Q8_0, w, x, y_f32=True)
    for kernel in LANES_KERNELS:
        assert _same(native.q_linear_lanes(native.Q8_0, w, x, y_f32=True, kernel=kernel), want), kernel


@lanes_only
def test_lanes_refuse_a_kernel_they_do_not_run():
    w = _rows(np.random.default_rng(0), native.Q8_0, 4, 1)
    others = [k for k in (native.KERNEL_AVX512BF16, native.KERNEL_AVX512BF16_INT32) if k not in LANES_KERNELS]
    for kernel in (native.KERNEL_PORTABLE, 0, 99, *others):  # AVX-512's on an AVX2-only CPU
        with pytest.raises(ValueError, match="q_linear_lanes"):
            native.q_linear_lanes(native.Q8_0, w, np.zeros((2, 32), np.uint16), kernel=kernel)

"""K-quant linear layers (csrc/kquant.c): Q4_K, Q5_K and Q6_K blocks against
native_ref.kq_linear bit for bit, the reference against gguf's own dequantization, and
batch invariance (a row's bits never depend on m, its neighbours or the threads)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mashbox import native, native_ref
from mashbox.model import csrc, linear

Q4_K, Q5_K, Q6_K = 12, 13, 14
TYPES = [Q4_K, Q5_K, Q6_K]
TYPE_IDS = ["q4_k", "q5_k", "q6_k"]
KERNELS, KERNEL_IDS = map(list, zip(*[(native.KERNEL_PORTABLE, "portable")]
                                     + ([(native.KERNEL_AVX512BF16, "avx512bf16")] if linear.bf16_kernel_available() else [])
                                     + ([(native.KERNEL_AVX2, "avx2")] if native.avx2_supported() else [])))
BLOCK = native_ref.KQ_BLOCK


def _half_bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(values.shape + (2,))


def _rows(rng: np.random.Generator, qtype: int, n: int, blocks: int) -> np.ndarray:
    """uint8[n, blocks * block bytes]: random integers and scales, d and dmin float16 of
    real models' sizes (and some float16 subnormals)."""
    size = native_ref.KQ_BLOCK_BYTES[qtype]
    w = rng.integers(0, 256, (n, blocks, size), dtype=np.uint8)
    d = rng.standard_normal((n, blocks)) * 10.0 ** rng.integers(-7, -1, (n, blocks))
    if qtype == Q6_K:
        w[..., 208:210] = _half_bits(d)
    else:
        w[..., 0:2] = _half_bits(d)
        w[..., 2:4] = _half_bits(np.abs(rng.standard_normal((n, blocks))) * 1e-3)
    return w.reshape(n, blocks * size)


def _x(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """bfloat16 bits: normal values of varied scale, zeros and denormals (read as zero)."""
    x = native_ref.f32_to_bf16((rng.standard_normal((m, k)) * 2.0 ** rng.integers(-20, 20, (m, 1))).astype(np.float32))
    x[rng.random((m, k)) < 0.05] = 0
    x[rng.random((m, k)) < 0.02] = rng.integers(1, 128, dtype=np.uint16)  # denormal bits
    return x


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bits, but +0 and -0 are one (the rule leaves a zero's sign open)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits, sign = (np.uint32, 0x7FFFFFFF) if a.dtype == np.float32 else (np.uint16, 0x7FFF)
    u, v = a.view(bits), b.view(bits)
    return bool(np.all((u == v) | (((u & bits(sign)) == 0) & ((v & bits(sign)) == 0))))


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_parts_are_ggufs_dequantization(qtype):
    """s * q - dmin * mn, from the reference's probes, is gguf's dequantization exactly,
    with integers where the format has them."""
    rng = np.random.default_rng(qtype)
    w = _rows(rng, qtype, 7, 3)
    q, s, mn, dmin = native_ref.kq_parts(w.reshape(7, 3, -1), qtype)
    want = gguf.quants.dequantize(w, gguf.GGMLQuantizationType(qtype)).reshape(7, 3, BLOCK)
    assert np.array_equal(s * q - dmin[..., None] * mn, want)
    lo, hi = {Q4_K: (0, 15), Q5_K: (0, 31), Q6_K: (-32, 31)}[qtype]
    assert np.array_equal(q, np.round(q)) and q.min() == lo and q.max() == hi
    assert np.array_equal(mn, np.round(mn)) and mn.min() >= 0 and mn.max() <= 63


@st.composite
def _problem(draw):
    qtype = draw(st.sampled_from(TYPES))
    m, n, blocks = draw(st.integers(1, 16)), draw(st.integers(1, 40)), draw(st.sampled_from([1, 2, 3]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    w = _rows(rng, qtype, n, blocks)
    x = _x(rng, m, blocks * BLOCK)
    pad = draw(st.sampled_from([0, 0, 16]))  # x rows ldx > k apart
    if pad:
        x = np.concatenate([x, np.zeros((m, pad), dtype=np.uint16)], axis=1)[:, :blocks * BLOCK]
    bias = draw(st.none() | hnp.arrays(np.float32, (n,), elements=st.floats(-1e3, 1e3, width=32)))
    mode = draw(st.sampled_from(["bf16", "f32", "add"]))
    add_to = native_ref.f32_to_bf16(rng.standard_normal((m, n)).astype(np.float32)) if mode == "add" else None
    return qtype, w, x, bias, mode == "f32", add_to


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@settings(max_examples=60, deadline=None)
@given(_problem())
def test_kernels_match_the_reference(kernel, problem):
    qtype, w, x, bias, y_f32, add_to = problem
    want = native_ref.kq_linear(qtype, w, np.ascontiguousarray(x), bias, y_f32, add_to)
    got = native.kq_linear(qtype, w, x, bias, y_f32, add_to, kernel=kernel)
    assert _same(got, want)


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_a_bigger_case_and_the_dense_product(qtype):
    """40 rows (three row groups) x 100 outputs x 5 blocks: both kernels equal the
    reference, which is close to the float64 product of x and gguf's dequantized w."""
    rng = np.random.default_rng(100 + qtype)
    n, blocks, m = 100, 5, 40
    w, x = _rows(rng, qtype, n, blocks), _x(rng, m, blocks * BLOCK)
    want = native_ref.kq_linear(qtype, w, x, y_f32=True)
    for kernel in KERNELS:
        assert _same(native.kq_linear(qtype, w, x, y_f32=True, kernel=kernel), want), kernel
    dense = gguf.quants.dequantize(w, gguf.GGMLQuantizationType(qtype)).astype(np.float64)
    exact = native_ref._flush(native_ref.bf16_to_f32(x)).astype(np.float64) @ dense.T
    scale = np.abs(native_ref.bf16_to_f32(x)).astype(np.float64) @ np.abs(dense).T
    assert np.all(np.abs(want - exact) <= 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_long_rows_and_a_second_tile(qtype):
    """Long rows (65 blocks; 12 blocks for a full row group and one more row) and 37
    outputs (a work item of 32, then 5): the same bits as the reference."""
    rng = np.random.default_rng(5)
    for m, blocks in ((9, 12), (2, 65), (1, 65)):
        w, x = _rows(rng, qtype, 37, blocks), _x(rng, m, blocks * BLOCK)
        want = native_ref.kq_linear(qtype, w, x, y_f32=True)
        for kernel in KERNELS:
            assert _same(native.kq_linear(qtype, w, x, y_f32=True, kernel=kernel), want), (kernel, m)


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_rows_do_not_depend_on_their_batch(kernel, qtype):
    """Row r of a batch of m equals the same row alone, for m across the 16-row groups,
    with the threads torch runs; and thread counts do not change bits."""
    rng = np.random.default_rng(7)
    n, blocks, total = 35, 2, 37
    w, x = _rows(rng, qtype, n, blocks), _x(rng, total, blocks * BLOCK)
    pool = csrc.parallel()
    threads = torch.get_num_threads()
    alone = np.concatenate([native.kq_linear(qtype, w, x[r:r + 1], kernel=kernel) for r in range(total)])
    for m in (1, 2, 15, 16, 17, 33, 37):
        for start in (0, total - m):
            got = native.kq_linear(qtype, w, x[start:start + m], kernel=kernel, parallel=pool, threads=threads)
            assert np.array_equal(got, alone[start:start + m]), (m, start)
    for t in (1, 2, 3):
        assert np.array_equal(native.kq_linear(qtype, w, x, kernel=kernel, parallel=pool, threads=t), alone)


def test_bad_sizes_are_refused():
    rng = np.random.default_rng(3)
    w, x = _rows(rng, Q4_K, 4, 2), _x(rng, 2, 2 * BLOCK)
    y = np.zeros((2, 4), dtype=np.uint16)
    args = dict(qtype=Q4_K, w=w.ctypes.data, row_bytes=w.shape[1], n=4, k=2 * BLOCK, x=x.ctypes.data,
                ldx=2 * BLOCK, m=2, bias=0, y=y.ctypes.data, y_mode=native.Y_BF16, ldy=4,
                kernel=native.KERNEL_PORTABLE, parallel=0, threads=1)
    native.kq_linear_ptr(**args)  # the good call runs
    for bad in (dict(qtype=8), dict(qtype=15), dict(k=BLOCK + 32, ldx=BLOCK + 32), dict(row_bytes=w.shape[1] - 1),
                dict(ldx=BLOCK), dict(ldy=3), dict(m=0), dict(n=0), dict(y_mode=3), dict(kernel=9)):
        with pytest.raises(ValueError, match="kq_linear"):
            native.kq_linear_ptr(**{**args, **bad})
    with pytest.raises(ValueError):
        native.kq_linear(Q4_K, w, x[:, :BLOCK + 2])

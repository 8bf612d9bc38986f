"""Decode attention (csrc/attention.c): the C kernels against the numpy reference, bit for
bit, and what the decoder relies on: a row's bits depend on its own query, keys and end
only (not on the rows beside it or the threads), and the result is softmax attention."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mashbox import native, native_ref
from mashbox.model import csrc, linear

_FAST = [(native.KERNEL_AVX512BF16, "avx512")] if linear.bf16_kernel_available() else []
_FAST += [(native.KERNEL_AVX2, "avx2")] if native.avx2_supported() else []
KERNELS = [native.KERNEL_PORTABLE] + [kernel for kernel, _ in _FAST]
KERNEL_IDS = ["portable"] + [name for _, name in _FAST]


def _bf16(a) -> np.ndarray:
    return native_ref.f32_to_bf16(np.asarray(a, dtype=np.float32))


@st.composite
def _problem(draw):
    heads, kv_heads = draw(st.sampled_from([(1, 1), (2, 1), (4, 4), (6, 2), (9, 3)]))
    d = draw(st.sampled_from([16, 32, 64, 128]))
    n_slots, capacity = draw(st.integers(1, 3)), draw(st.integers(1, 200))
    t = draw(st.integers(0, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q_scale = draw(st.sampled_from([0.05, 1.0, 8.0]))  # flat to peaked softmax
    q = _bf16(rng.normal(size=(t, heads * d + draw(st.sampled_from([0, 3])))) * q_scale)
    k = rng.normal(size=(n_slots, kv_heads, capacity, d))
    if draw(st.booleans()):  # keys that score higher and higher: every block raises the max
        k = k * 0.1 + np.linspace(0, 4, capacity)[None, None, :, None]
    k_cache, v_cache = _bf16(k), _bf16(rng.normal(size=(n_slots, kv_heads, capacity, d)))
    rows = rng.permutation(t).astype(np.int64)
    slots = rng.integers(0, n_slots, t).astype(np.int64)
    ends = rng.integers(1, capacity + 1, t).astype(np.int64)
    window = draw(st.sampled_from([0, 0, 1, 7, 64, 100]))
    return q, rows, slots, ends, heads, kv_heads, window, 1 / np.sqrt(d), k_cache, v_cache


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@settings(max_examples=80, deadline=None)
@given(_problem())
def test_kernels_match_the_reference(kernel, problem):
    q, rows, slots, ends, heads, kv_heads, window, scale, k_cache, v_cache = problem
    want = np.zeros((q.shape[0], q.shape[1]), np.uint16)
    got = want.copy()
    native_ref.bf16_attention(q, rows, slots, ends, heads, kv_heads, window, scale, k_cache, v_cache, want)
    native.bf16_attention(q, rows, slots, ends, heads, kv_heads, window, scale, k_cache, v_cache, got,
                          kernel=kernel)
    assert np.array_equal(got, want)


@settings(max_examples=30, deadline=None)
@given(_problem())
def test_it_is_softmax_attention(problem):
    """Within bfloat16's rounding of float64 attention over keys [end - window, end)."""
    q, rows, slots, ends, heads, kv_heads, window, scale, k_cache, v_cache = problem
    out = np.zeros((q.shape[0], q.shape[1]), np.uint16)
    native.bf16_attention(q, rows, slots, ends, heads, kv_heads, window, scale, k_cache, v_cache, out)
    d, group = k_cache.shape[3], heads // kv_heads
    f64 = lambda a: native_ref.bf16_to_f32(a).astype(np.float64)  # noqa: E731
    for r in range(len(rows)):
        lo = ends[r] - window if 0 < window < ends[r] else 0
        for h in range(heads):
            k = f64(k_cache[slots[r], h // group, lo:ends[r]])
            v = f64(v_cache[slots[r], h // group, lo:ends[r]])
            s = k @ f64(q[rows[r], h * d:(h + 1) * d]) * scale
            p = np.exp(s - s.max())
            want = p @ v / p.sum()
            got = f64(out[rows[r], h * d:(h + 1) * d])
            assert np.abs(got - want).max() <= 2**-7 * max(np.abs(want).max(), np.abs(v).max() * 1e-2)


def test_exp_is_close_to_libm_and_zero_far_below():
    x = np.concatenate([np.linspace(-80, 0, 200001, dtype=np.float32), np.float32([-0.0, -80.5, -1e30, -np.inf])])
    got = native_ref.att_exp(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    inside = x >= -80
    assert np.all(np.abs(got[inside] - want[inside]) <= 2e-7 * want[inside])
    assert np.all(got[~inside] == 0)
    assert native_ref.att_exp(np.float32([0.0]))[0] == 1.0  # a block whose max stays: scaled by exactly 1


def _torch_problem(t: int, keys: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    H, KV, D, slots, cap = 9, 3, 64, 8, 1200
    q = torch.randn(t, (H + 2 * KV) * D, generator=gen).bfloat16()  # q heads first, as in qkv
    k = torch.randn(slots, KV, cap, D, generator=gen).bfloat16()
    v = torch.randn(slots, KV, cap, D, generator=gen).bfloat16()
    ends = torch.randint(1, keys + 1, (t,), generator=gen)
    return q, k, v, ends, H, KV, D


def _run(q, k, v, rows, slots, ends, H, KV, D, out, threads, kernel=None):
    native.bf16_attention_ptr(
        q.data_ptr(), q.stride(0), q.shape[0], rows.data_ptr(), slots.data_ptr(), ends.data_ptr(),
        len(rows), H, KV, D, 0, 0.125, k.data_ptr(), v.data_ptr(), k.shape[0], k.shape[2], out.data_ptr(),
        out.shape[1], native.bf16_kernel() if kernel is None else kernel, csrc.parallel(), threads)


def test_rows_and_threads_do_not_change_bits():
    """8 rows of up to 1,100 keys (past the one-thread threshold) with 1, 2 and 3 threads,
    and each row alone: the same bits."""
    q, k, v, ends, H, KV, D = _torch_problem(8, 1100)
    rows, slots = torch.arange(8), torch.tensor([3, 1, 4, 1, 5, 0, 2, 6])
    outs = []
    for threads in (1, 2, 3):
        out = torch.zeros(8, H * D, dtype=torch.bfloat16)
        _run(q, k, v, rows, slots, ends, H, KV, D, out, threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for r in range(8):
        alone = torch.zeros(8, H * D, dtype=torch.bfloat16)
        _run(q, k, v, rows[r:r + 1], slots[r:r + 1], ends[r:r + 1], H, KV, D, alone, 2)
        assert torch.equal(alone[r], outs[0][r])


def test_bad_arguments_are_refused():
    q, k, v, ends, H, KV, D = _torch_problem(2, 100)
    out = torch.zeros(2, H * D, dtype=torch.bfloat16)
    good = dict(rows=torch.tensor([0, 1]), slots=torch.tensor([0, 7]), ends=torch.tensor([1, 1200]))
    _run(q, k, v, *good.values(), H, KV, D, out, 1)
    for name, bad in (("rows", [0, 2]), ("rows", [-1, 0]), ("slots", [0, 8]), ("ends", [0, 5]),
                      ("ends", [1, 1201])):
        args = dict(good, **{name: torch.tensor(bad)})
        with pytest.raises(ValueError, match="bf16_attention"):
            _run(q, k, v, *args.values(), H, KV, D, out, 1)
    for heads, kv_heads, d in ((9, 2, 64), (66, 2, 64), (9, 3, 24), (9, 3, 512)):
        with pytest.raises(ValueError, match="bf16_attention"):
            _run(q, k, v, *good.values(), heads, kv_heads, d, out, 1)
    with pytest.raises(ValueError, match="bf16_attention"):
        _run(q, k, v, *good.values(), H, KV, D, out, 1, kernel=7)
    with pytest.raises(ValueError, match="one entry per row"):
        native.bf16_attention(q.view(torch.int16).numpy().view(np.uint16), np.array([0]), np.array([0, 1]),
                              np.array([1]), H, KV, 0, 0.125, k.view(torch.int16).numpy().view(np.uint16),
                              v.view(torch.int16).numpy().view(np.uint16), out.view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
def test_blocks_that_raise_the_max_rescale_alike(kernel):
    """Scores that grow key after key: every block of 64 raises the running max, so the
    earlier blocks' sums are rescaled by e(m - m') hundreds of times (the step where a
    kernel that took libm's exp, or rescaled in another order, would show)."""
    rng = np.random.default_rng(9)
    heads, kv_heads, d, capacity = 9, 3, 64, 600
    q = _bf16(np.abs(rng.normal(size=(8, heads * d))) * 0.3)
    k = _bf16(rng.normal(size=(2, kv_heads, capacity, d)) * 0.2 + np.linspace(0, 3, capacity)[None, None, :, None])
    v = _bf16(rng.normal(size=(2, kv_heads, capacity, d)))
    rows, slots = np.arange(8), np.array([0, 1] * 4)
    ends = np.array([600, 599, 577, 513, 448, 300, 129, 65])
    want, got = np.zeros((8, heads * d), np.uint16), np.zeros((8, heads * d), np.uint16)
    native_ref.bf16_attention(q, rows, slots, ends, heads, kv_heads, 0, 0.125, k, v, want)
    native.bf16_attention(q, rows, slots, ends, heads, kv_heads, 0, 0.125, k, v, got, kernel=kernel)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
def test_keys_far_below_the_max_weigh_exactly_zero(kernel):
    """e(x) is 0 below -80, not e^-80: keys scoring 256 under the top one add nothing, so
    the dims where the top key's value is 0 come out exactly 0 (100 keys: two blocks)."""
    d, keys = 16, 100
    q = _bf16(np.full((1, d), 8.0))
    k = np.full((1, 1, keys, d), -1.0)
    k[0, 0, 0] = 1.0  # score 128; every other key -128
    v = np.ones((1, 1, keys, d))
    v[0, 0, 0, :8] = 0.0
    k_cache, v_cache = _bf16(k), _bf16(v)
    args = (np.arange(1), np.zeros(1, np.int64), np.array([keys]), 1, 1, 0, 1.0, k_cache, v_cache)
    want, got = np.zeros((1, d), np.uint16), np.zeros((1, d), np.uint16)
    native_ref.bf16_attention(q, *args, want)
    native.bf16_attention(q, *args, got, kernel=kernel)
    assert np.array_equal(got, want)
    assert np.array_equal(native_ref.bf16_to_f32(got)[0], [0.0] * 8 + [1.0] * 8)

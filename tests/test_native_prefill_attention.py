"""Prefill attention (csrc/attention.c, mb_bf16_prefill_attention): the C kernels against
the numpy reference, bit for bit, and what the decoder relies on: a query's bits depend on
its own vector, keys and position only (not on how its prompt was chunked, the tile it
lands in, the rows beside it or the threads), and the result is causal softmax attention."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mashbox import native, native_ref
from mashbox.model import csrc, linear

KERNELS = [native.KERNEL_PORTABLE] + ([native.KERNEL_AVX512BF16] if linear.bf16_kernel_available() else [])
KERNEL_IDS = ["portable", "avx512"][:len(KERNELS)]


def _bf16(a) -> np.ndarray:
    return native_ref.f32_to_bf16(np.asarray(a, dtype=np.float32))


@st.composite
def _problem(draw):
    heads, kv_heads = draw(st.sampled_from([(1, 1), (2, 1), (4, 4), (6, 2), (9, 3), (16, 2)]))
    d = draw(st.sampled_from([16, 32, 48, 64, 128]))
    n_slots, capacity = draw(st.integers(1, 3)), draw(st.integers(1, 200))
    t = draw(st.integers(0, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lens = np.minimum(rng.integers(1, 40, t), capacity).astype(np.int64)
    starts = np.array([rng.integers(0, capacity - n + 1) for n in lens], dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if t else np.zeros(0, np.int64)
    q_scale = draw(st.sampled_from([0.05, 1.0, 8.0]))  # flat to peaked softmax
    q = _bf16(rng.normal(size=(int(lens.sum()), heads * d + draw(st.sampled_from([0, 3])))) * q_scale)
    k = rng.normal(size=(n_slots, kv_heads, capacity, d))
    if draw(st.booleans()):  # keys that score higher and higher: every block raises the max
        k = k * 0.1 + np.linspace(0, 4, capacity)[None, None, :, None]
    k_cache, v_cache = _bf16(k), _bf16(rng.normal(size=(n_slots, kv_heads, capacity, d)))
    slots = rng.integers(0, n_slots, t).astype(np.int64)
    window = draw(st.sampled_from([0, 0, 1, 7, 64, 100]))
    return q, firsts, slots, starts, lens, heads, kv_heads, window, 1 / np.sqrt(d), k_cache, v_cache


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@settings(max_examples=60, deadline=None)
@given(_problem())
def test_kernels_match_the_reference(kernel, problem):
    q = problem[0]
    want = np.zeros((q.shape[0], q.shape[1]), np.uint16)
    got = want.copy()
    native_ref.bf16_prefill_attention(*problem, want)
    native.bf16_prefill_attention(*problem, got, kernel=kernel)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("window", [0, 100])
def test_runs_of_tiles_match_the_reference(window):
    """150 queries (10 tiles: runs of 4, 4 and 2 walk the keys together on the AVX-512
    kernel) at positions 1030.. with a window under which the tiles of one run start in
    different key blocks, beside a 3-token row of another slot: the reference's bits, on
    every kernel."""
    rng = np.random.default_rng(7)
    H, KV, D, cap = 9, 3, 64, 1200
    q = _bf16(rng.normal(size=(153, H * D)))
    k = _bf16(rng.normal(size=(2, KV, cap, D)) * 0.5)
    v = _bf16(rng.normal(size=(2, KV, cap, D)))
    rows = [np.array(x, dtype=np.int64) for x in ([0, 150], [1, 0], [1030, 5], [150, 3])]
    want = np.zeros_like(q)
    native_ref.bf16_prefill_attention(q, *rows, H, KV, window, 0.125, k, v, want)
    for kernel in KERNELS:
        got = np.zeros_like(q)
        native.bf16_prefill_attention(q, *rows, H, KV, window, 0.125, k, v, got, kernel=kernel)
        assert np.array_equal(got, want), kernel


def test_exp2_is_accurate_to_bfloat16():
    """pf_exp2 (the kernels' 2^x): within 3e-6 of 2^x where the result is normal, 0 below
    2^-126 and for -inf or NaN, 1 at 0."""
    x = np.concatenate([-np.linspace(0, 126, 400001), [-126.5, -149.9, -200, -np.inf, np.nan]]).astype(np.float32)
    got = native_ref.pf_exp2(x)
    want = 2.0 ** x[:400001].astype(np.float64)
    normal = want >= 2.0 ** -126
    assert np.abs(got[:400001][normal] / want[normal] - 1).max() < 3e-6
    assert np.all(got[:400001][~normal] == 0) and np.all(got[400001:] == 0) and got[0] == 1


@settings(max_examples=25, deadline=None)
@given(_problem())
def test_it_is_causal_softmax_attention(problem):
    """Within bfloat16's rounding of float64 attention over keys (p - window, p]."""
    q, firsts, slots, starts, lens, heads, kv_heads, window, scale, k_cache, v_cache = problem
    out = np.zeros((q.shape[0], q.shape[1]), np.uint16)
    native.bf16_prefill_attention(*problem, out)
    d, group = k_cache.shape[3], heads // kv_heads
    f64 = lambda a: native_ref.bf16_to_f32(a).astype(np.float64)  # noqa: E731
    for r in range(len(firsts)):
        for i in range(lens[r]):
            p = starts[r] + i
            lo = p + 1 - window if 0 < window <= p else 0
            for h in range(heads):
                k = f64(k_cache[slots[r], h // group, lo:p + 1])
                v = f64(v_cache[slots[r], h // group, lo:p + 1])
                s = k @ f64(q[firsts[r] + i, h * d:(h + 1) * d]) * scale
                w = np.exp(s - s.max())
                want = w @ v / w.sum()
                got = f64(out[firsts[r] + i, h * d:(h + 1) * d])
                # probabilities rounded to bfloat16 (8 bits) weigh the values
                assert np.abs(got - want).max() <= 2**-6 * max(np.abs(want).max(), np.abs(v).max() * 1e-2)


def _torch_problem(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    H, KV, D, slots, cap = 9, 3, 64, 4, 1536  # the default model's attention shape
    q = torch.randn(tokens, (H + 2 * KV) * D, generator=gen).bfloat16()  # q heads first, as in qkv
    k = torch.randn(slots, KV, cap, D, generator=gen).bfloat16()
    v = torch.randn(slots, KV, cap, D, generator=gen).bfloat16()
    return q, k, v, H, KV, D


def _run(q, k, v, rows, H, KV, D, out, kernel, window=0):
    """rows: (first token, slot, start, len) of each prompt row."""
    firsts, slots, starts, lens = (torch.tensor([r[i] for r in rows], dtype=torch.int64) for i in range(4))
    csrc.prefill_attention(q, firsts, slots, starts, lens, H, KV, window, 0.125, k, v, out, kernel)


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("window", [0, 300])
def test_chunks_company_and_threads_do_not_change_bits(kernel, window):
    """A 1,100-token prompt in one row, in chunks of 1, 7, 300 and the rest (each chunk's
    queries moved to other tiles), and beside another slot's row, with 1 and 2 threads:
    every query gets the same bits."""
    q, k, v, H, KV, D = _torch_problem(1100)
    whole = torch.zeros(1100, H * D, dtype=torch.bfloat16)
    _run(q, k, v, [(0, 2, 0, 1100)], H, KV, D, whole, kernel, window)
    chunked = torch.zeros_like(whole)
    for lo, hi in ((0, 1), (1, 8), (8, 308), (308, 1100)):
        _run(q[lo:hi], k, v, [(0, 2, lo, hi - lo)], H, KV, D, chunked[lo:hi], kernel, window)
    assert torch.equal(whole, chunked)
    crowded = torch.zeros(1100 + 50, H * D, dtype=torch.bfloat16)
    qq = torch.cat([q[:50], q[600:1100]])  # slot 0's 50 tokens, then the prompt's last 500
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _run(qq, k, v, [(0, 0, 0, 50), (50, 2, 600, 500)], H, KV, D, crowded[:550], kernel, window)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(crowded[50:550], whole[600:])


def test_bad_arguments_are_refused():
    q, k, v, H, KV, D = _torch_problem(8)
    out = torch.zeros(8, H * D, dtype=torch.bfloat16)
    kernel = native.KERNEL_PORTABLE
    _run(q, k, v, [(0, 3, 1528, 8)], H, KV, D, out, kernel)
    for bad in ((1, 0, 0, 8), (-1, 0, 0, 2), (0, 4, 0, 8), (0, 0, 1529, 8), (0, 0, -1, 2), (0, 0, 0, 0)):
        with pytest.raises(ValueError, match="bf16_prefill_attention"):
            _run(q, k, v, [bad], H, KV, D, out, kernel)
    with pytest.raises(ValueError, match="k_cache"):  # not the caches' K/V heads
        _run(q, k, v, [(0, 0, 0, 8)], 9, 2, D, out, kernel)
    one = lambda x: np.array([x], dtype=np.int64)  # noqa: E731
    for heads, d in ((17, 16), (8, 256)):  # 17 query heads per K/V head; group * head_dim 2048
        cache = np.zeros((1, 1, 4, d), np.uint16)
        with pytest.raises(ValueError, match="bf16_prefill_attention"):
            native.bf16_prefill_attention(np.zeros((1, heads * d), np.uint16), one(0), one(0), one(0), one(1),
                                          heads, 1, 0, 0.1, cache, cache, np.zeros((1, heads * d), np.uint16),
                                          kernel=kernel)
    with pytest.raises(ValueError, match="bf16_prefill_attention"):
        _run(q, k, v, [(0, 0, 0, 8)], H, KV, D, out, 7)
    with pytest.raises(ValueError, match="slots must be"):  # one entry per row
        csrc.prefill_attention(q, torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1]),
                               H, KV, 0, 0.125, k, v, out, kernel)

"""bfloat16 linear layers (csrc/linear.c): the C kernels against the reference, and what
the decoder relies on (a row's bits never depend on the rest of its batch, the tile it
lands in, or the threads that run it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mashbox import native, native_ref
from mashbox.model import linear, row_ops

KERNELS, KERNEL_IDS = map(list, zip(*[(native.KERNEL_PORTABLE, "portable")]
                                     + ([(native.KERNEL_AVX512BF16, "avx512bf16")] if linear.bf16_kernel_available() else [])
                                     + ([(native.KERNEL_AVX2, "avx2")] if native.avx2_supported() else [])))


def _bf16(a) -> np.ndarray:
    return native_ref.f32_to_bf16(np.asarray(a, dtype=np.float32))


def _same(a: np.ndarray, b: np.ndarray, y_f32: bool) -> bool:
    """Equal bits, but +0 and -0 are one (the rule leaves an underflow's zero sign open)."""
    u = a.view(np.uint32 if y_f32 else np.uint16)
    v = b.view(np.uint32 if y_f32 else np.uint16)
    sign = np.uint32(0x7FFFFFFF) if y_f32 else np.uint16(0x7FFF)
    return bool(np.all((u == v) | (((u & sign) == 0) & ((v & sign) == 0))))


# The matrices are filled by numpy from a seed hypothesis draws, in one of three kinds it
# picks: drawn element by element, hypothesis' own bookkeeping took ~150 ms an example
# (most of this file's time), and shrinking a 10k-element array finds nothing a seed does not.
#   floats: finite bfloat16 values, sums kept finite: zeros of both signs, small integers,
#           the range's ends, else magnitudes 2**-60 .. 2**50 (tiny ones only where the
#           other side is 1 or 0 matters: they appear beside those specials);
#   bits:   raw bits: zeros and denormal bfloat16 inputs (read as zero) half the time,
#           else exponents keeping every product inside float32's normal range (the
#           rule's limits);
#   fill:   one value everywhere (what hypothesis' arrays often make: all zeros, all -0)
#           with a few floats among it.
_SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 2.0**50, -(2.0**50), 2.0**-60, -(2.0**-60)], np.float32)


def _floats(rng: np.random.Generator, n: int) -> np.ndarray:
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    wide = sign * np.exp2(rng.uniform(-60.0, 50.0, n))
    small = rng.integers(-16, 17, n).astype(np.float64)
    pick = rng.random(n)
    v = np.where(pick < 0.5, wide, np.where(pick < 0.8, small, _SPECIALS[rng.integers(0, len(_SPECIALS), n)]))
    return v.astype(np.float32)


def _matrix(draw, shape):
    """bfloat16 bits (uint16) of the given shape."""
    kind = draw(st.sampled_from(("floats", "bits", "fill")))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = int(np.prod(shape))
    if kind == "bits":
        exp = np.where(rng.random(n) < 0.5, 0, rng.integers(127 - 60, 127 + 50, n))
        bits = (rng.integers(0, 2, n) << 15) | (exp << 7) | rng.integers(0, 128, n)
        return bits.astype(np.uint16).reshape(shape)
    if kind == "fill":
        v = np.full(n, draw(st.sampled_from(list(_SPECIALS))), np.float32)
        few = rng.integers(0, max(n, 1), rng.integers(0, 4) if n else 0)
        v[few] = _floats(rng, len(few))
        return _bf16(v.reshape(shape))
    return _bf16(_floats(rng, n).reshape(shape))


@st.composite
def _problem(draw, max_m=14, max_n=140, max_pairs=40):
    m, n, k = draw(st.integers(1, max_m)), draw(st.integers(1, max_n)), 2 * draw(st.integers(1, max_pairs))
    x, w = _matrix(draw, (m, k)), _matrix(draw, (n, k))
    bias = draw(st.none() | hnp.arrays(np.float32, (n,), elements=st.floats(-1e3, 1e3, width=32)))
    return x, w, bias, draw(st.booleans())


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@settings(max_examples=120, deadline=None)
@given(_problem())
def test_kernels_match_the_reference(kernel, problem):
    x, w, bias, y_f32 = problem
    want = native_ref.bf16_linear(x, w, bias, y_f32)
    got = native.bf16_linear(x, w, bias, y_f32, kernel=kernel)
    assert got.dtype == (np.float32 if y_f32 else np.uint16) and got.shape == want.shape
    assert _same(got, want, y_f32)


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
def test_the_documented_order(kernel):
    """x1 w1 before x0 w0, pair after pair, each add rounded: with x = (2**-24, 1, -1,
    2**-24) and w all ones, 1 + 2**-24 rounds to 1 twice and the sum is 0; in plain
    index order (or even-first) the last 2**-24 survives."""
    x = _bf16([[2.0**-24, 1.0, -1.0, 2.0**-24]])
    w = _bf16([[1.0, 1.0, 1.0, 1.0]])
    assert native_ref.bf16_linear(x, w, y_f32=True)[0, 0] == 0.0
    assert native.bf16_linear(x, w, y_f32=True, kernel=kernel)[0, 0] == 0.0
    assert native.bf16_linear(x[:, [1, 0, 3, 2]], w, y_f32=True, kernel=kernel)[0, 0] == np.float32(2.0**-24)


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
def test_rows_do_not_depend_on_their_batch(kernel):
    """Row r of a batch of m equals the same row computed alone, for m across the kernel's
    8-row micro-tiles and 48-row work items, with the threads torch runs."""
    gen = torch.Generator().manual_seed(0)
    n, k = 200, 96  # 5 tiles of 48, the last one partly past n
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    lin = linear.BF16Linear(w, bias, kernel=kernel)
    x = torch.randn(101, k, generator=gen).bfloat16()
    alone = torch.cat([lin(x[r:r + 1]) for r in range(101)])
    for m in (1, 2, 5, 7, 8, 9, 16, 17, 48, 49, 101):
        for start in (0, 101 - m):
            assert torch.equal(lin(x[start:start + m]), alone[start:start + m]), (m, start)
    assert torch.equal(lin(x, torch.float32).bfloat16(), alone)


def test_threads_do_not_change_bits():
    if not linear.bf16_kernel_available():
        pytest.skip("no AVX512-BF16 here")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1000, 576, generator=gen).bfloat16()
    lin = linear.BF16Linear(w)
    x = torch.randn(70, 576, generator=gen).bfloat16()
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(lin(x))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_close_to_torch_and_strided_inputs():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(300, 128, generator=gen).bfloat16()
    bias = torch.randn(300, generator=gen).bfloat16()
    lin = linear.BF16Linear(w, bias)
    wide = torch.randn(9, 200, generator=gen).bfloat16()
    x = wide[:, 40:168]  # rows 200 apart: the kernel takes the stride as it is
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    got = lin(x, torch.float32)
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()
    assert torch.equal(lin(x), lin(x.contiguous()))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="even input size"):
        linear.BF16Linear(torch.zeros(4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        linear.BF16Linear(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="even k"):
        native.bf16_linear(np.zeros((1, 3), np.uint16), np.zeros((2, 3), np.uint16))
    with pytest.raises(ValueError):
        native.bf16_linear_ptr(0, 1, 1, 0, 1, 3, 0, 0, native.Y_BF16, 1, native.KERNEL_PORTABLE, 0, 1)
    with pytest.raises(ValueError):
        native.bf16_linear_ptr(0, 4, 1, 0, 1, 4, 0, 0, 3, 1, native.KERNEL_PORTABLE, 0, 1)


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@settings(max_examples=60, deadline=None)
@given(_problem(max_m=7, max_n=70, max_pairs=24), st.data())
def test_residual_add_matches_the_reference(kernel, problem, data):
    x, w, bias, _ = problem
    add_to = _matrix(data.draw, (x.shape[0], w.shape[0]))
    want = native_ref.bf16_linear(x, w, bias, add_to=add_to)
    got = native.bf16_linear(x, w, bias, add_to=add_to, kernel=kernel)
    assert _same(got, want, False)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 80), st.data(), st.sampled_from([1e-5, 1e-6, 0.0]))
def test_rmsnorm_matches_the_reference(m, k, data, eps):
    x = _matrix(data.draw, (m, k))
    w = _matrix(data.draw, (1, k))[0]
    want = native_ref.bf16_rmsnorm(x, w, eps)
    got = native.bf16_rmsnorm(x, w, eps)
    nan = np.isnan(native_ref.bf16_to_f32(want))  # all-zero rows with eps 0: 0 * inf
    assert np.array_equal(np.isnan(native_ref.bf16_to_f32(got)), nan)
    assert np.array_equal(got[~nan], want[~nan])


def test_rmsnorm_is_close_to_torch():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 576, generator=gen) * 4).bfloat16()
    w = torch.randn(576, generator=gen).bfloat16()
    got = row_ops.rms_norm(x, w, 1e-5).float()
    want = torch.nn.functional.rms_norm(x.float(), (576,), w.float(), 1e-5)
    assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()
    assert torch.equal(row_ops.rms_norm(x[7:8], w, 1e-5), row_ops.rms_norm(x, w, 1e-5)[7:8])


def test_add_into_updates_the_residual_in_place():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 32, generator=gen).bfloat16()
    lin = linear.BF16Linear(w)
    x = torch.randn(3, 32, generator=gen).bfloat16()
    res = torch.randn(3, 64, generator=gen).bfloat16()
    want = (res.float() + x.float() @ w.float().T).bfloat16()
    got = res.clone()
    lin.add_into(x, got)
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        lin.add_into(x, torch.zeros(3, 64))


@st.composite
def _rope_problem(draw):
    heads, kv_heads = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    d, t, n_slots, capacity = 2 * draw(st.integers(1, 8)), draw(st.integers(0, 6)), draw(st.integers(1, 3)), draw(st.integers(6, 12))
    qkv = _matrix(draw, (t, (heads + 2 * kv_heads) * d))
    cos, sin = _matrix(draw, (capacity, d)), _matrix(draw, (capacity, d))
    positions = np.array(draw(st.lists(st.integers(0, capacity - 1), min_size=t, max_size=t, unique=True)), dtype=np.int64)
    slots = np.array(draw(st.lists(st.integers(0, n_slots - 1), min_size=t, max_size=t)), dtype=np.int64)
    cache = [_matrix(draw, (n_slots * kv_heads * capacity, d)).reshape(n_slots, kv_heads, capacity, d) for _ in range(2)]
    return qkv, heads, kv_heads, cos, sin, positions, slots, cache


@settings(max_examples=100, deadline=None)
@given(_rope_problem())
def test_rope_kv_matches_the_reference(problem):
    qkv, heads, kv_heads, cos, sin, positions, slots, (k_cache, v_cache) = problem
    got = [qkv.copy(), k_cache.copy(), v_cache.copy()]
    want = [qkv.copy(), k_cache.copy(), v_cache.copy()]
    native.bf16_rope_kv(got[0], heads, kv_heads, cos, sin, positions, slots, got[1], got[2])
    native_ref.bf16_rope_kv(want[0], heads, kv_heads, cos, sin, positions, slots, want[1], want[2])
    for a, b in zip(got, want):
        assert _same(a, b, False)


def test_rope_kv_is_the_decoders_rope_and_refuses_bad_positions():
    """Against RopeTable.apply (torch, bfloat16 ops) within a rounding, and out-of-range
    positions or slots are refused before anything is written."""
    table = _rope_table(heads=2, head_dim=32, length=64)
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(3, 4 * 32, generator=gen).bfloat16()
    k_cache, v_cache = torch.zeros(2, 1, 64, 32, dtype=torch.bfloat16), torch.zeros(2, 1, 64, 32, dtype=torch.bfloat16)
    positions, slots = torch.tensor([5, 6, 40]), torch.tensor([0, 0, 1])
    want = table.apply(qkv.view(3, 4, 32)[:, :3], table.cos[positions].unsqueeze(1), table.sin[positions].unsqueeze(1))
    v = qkv.view(3, 4, 32)[:, 3].clone()
    got = qkv.clone()
    row_ops.rope_kv(got, 3, 2, 1, table.cos, table.sin, positions, slots, k_cache, v_cache)
    assert (got.view(3, 4, 32)[:, :2].float() - want[:, :2].float()).abs().max() < 0.02
    assert (k_cache[slots, 0, positions].float() - want[:, 2].float()).abs().max() < 0.02
    assert torch.equal(v_cache[slots, 0, positions], v)
    before = k_cache.clone()
    for bad_pos, bad_slot in (([5, 64], [0, 0]), ([5, -1], [0, 0]), ([5, 6], [0, 2])):
        with pytest.raises(ValueError):
            row_ops.rope_kv(qkv.clone(), 2, 2, 1, table.cos, table.sin, torch.tensor(bad_pos),
                           torch.tensor(bad_slot), k_cache, v_cache)
    assert torch.equal(k_cache, before)
    with pytest.raises(ValueError):  # a table shorter than the cache: its end is the limit
        row_ops.rope_kv(qkv.clone(), 1, 2, 1, table.cos[:10], table.sin[:10], torch.tensor([10]),
                       torch.tensor([0]), k_cache, v_cache)



@settings(max_examples=100, deadline=None)
@given(st.integers(1, 130), st.integers(1, 20), st.data())
def test_gather_rows_reads_the_packed_rows(n, pairs, data):
    w = _matrix(data.draw, (n, 2 * pairs))
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=12)), dtype=np.int64)
    assert np.array_equal(native.bf16_gather_rows(w, ids), w[ids])
    with pytest.raises(ValueError):
        native.bf16_gather_rows(w, np.array([n], dtype=np.int64))


def test_weight_arena_hands_out_aligned_parts_and_refuses_more():
    sizes = [100, 4096, 70]
    arena = linear.WeightArena(linear.arena_bytes(sizes))
    parts = [arena.take(n) for n in sizes]
    assert parts[0].data_ptr() % linear.HUGE_PAGE == 0  # the first on a huge-page boundary
    assert all(p.data_ptr() % 64 == 0 for p in parts) and [p.numel() for p in parts] == sizes
    assert parts[1].data_ptr() >= parts[0].data_ptr() + 100
    with pytest.raises(ValueError, match="more bytes"):
        arena.take(1)
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    arena = linear.WeightArena(linear.arena_bytes([linear.BF16Linear.packed_bytes(w)]))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert torch.equal(linear.BF16Linear(w, into=arena.take(linear.BF16Linear.packed_bytes(w)))(x),
                       linear.BF16Linear(w)(x))
    with pytest.raises(ValueError, match="packs to"):
        linear.BF16Linear(w, into=torch.empty(10, dtype=torch.uint8))



@settings(max_examples=150, deadline=None)
@given(st.integers(0, 6), st.integers(1, 70), st.data())
def test_silu_mul_matches_the_reference(m, n, data):
    x = _matrix(data.draw, (m, 2 * n))
    want = native_ref.bf16_silu_mul(x)
    got = native.bf16_silu_mul(x)
    nan = np.isnan(native_ref.bf16_to_f32(want))  # inf * 0 and the like
    assert np.array_equal(np.isnan(native_ref.bf16_to_f32(got)), nan)
    assert np.array_equal(got[~nan], want[~nan])


def test_silu_mul_is_close_to_torch_and_refuses_odd_widths():
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 2 * 1536, generator=gen) * 3).bfloat16()
    x[0, :4] = torch.tensor([-100.0, -88.0, 0.0, 100.0])  # far below and above exp's range
    gate, up = x.float().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = row_ops.silu_mul(x).float()
    assert (got - want).abs().max().item() <= 2 ** -8 * want.abs().max().item()
    assert torch.equal(row_ops.silu_mul(x[2:3]), row_ops.silu_mul(x)[2:3])
    with pytest.raises(ValueError, match="halves"):
        native.bf16_silu_mul(np.zeros((1, 3), np.uint16))


def test_row_ops_split_between_threads_keep_their_bits():
    """rmsnorm, silu_mul and rope_kv on a prefill chunk's rows (big enough for csrc to split
    them between the pool's threads) give the bits of one thread, and of the rows alone."""
    table = _rope_table(heads=3, head_dim=64, length=512)
    gen = torch.Generator().manual_seed(9)
    m = 300  # 300 x 576 elements: past csrc's MB_ROWS_PARALLEL
    x, w = torch.randn(m, 576, generator=gen).bfloat16(), torch.randn(576, generator=gen).bfloat16()
    gu = (torch.randn(m, 2 * 1536, generator=gen) * 4).bfloat16()
    qkv = torch.randn(m, 5 * 64, generator=gen).bfloat16()
    positions, slots = torch.randperm(512, generator=gen)[:m], torch.zeros(m, dtype=torch.int64)

    def run():
        k_cache, v_cache = torch.zeros(1, 1, 512, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 512, 64, dtype=torch.bfloat16)
        q = qkv.clone()
        row_ops.rope_kv(q, m, 3, 1, table.cos, table.sin, positions, slots, k_cache, v_cache)
        return row_ops.rms_norm(x, w, 1e-5), row_ops.silu_mul(gu), q, k_cache, v_cache

    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(run())
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(row_ops.rms_norm(x[17:18], w, 1e-5), outs[1][0][17:18])
    assert torch.equal(row_ops.silu_mul(gu[250:251]), outs[1][1][250:251])


def _rope_table(heads: int, head_dim: int, length: int):
    """A plain-rope RopeTable (bfloat16, CPU) for `heads` query heads over one kv head."""
    from mashbox.model.model_config import ModelConfig
    from mashbox.model.rope import RopeTable

    config = ModelConfig(arch="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1,
                         num_heads=heads, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-5,
                         rope_theta=10000.0, rope_scaling=None, max_position_embeddings=length,
                         tie_word_embeddings=False, attention_bias=False, qk_norm=False)
    return RopeTable(config, length, torch.bfloat16, torch.device("cpu"))

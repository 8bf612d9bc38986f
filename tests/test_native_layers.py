"""A decode step's layers in one call (csrc/layers.c): C against the numpy reference
(native_ref.bf16_decode_layers, the same calls by the reference's own functions), bit for
bit, on each kernel; the scratch size is C's rule, and C refuses a scratch too small."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mashbox import native, native_ref
from mashbox.model import linear

KERNELS = [native.KERNEL_PORTABLE] + ([native.KERNEL_AVX512BF16] if linear.bf16_kernel_available() else [])
KERNEL_IDS = ["portable", "avx512bf16"][:len(KERNELS)]


def _bf16(a) -> np.ndarray:
    return native_ref.f32_to_bf16(np.asarray(a, dtype=np.float32))


@st.composite
def _problem(draw):
    heads, kv_heads = draw(st.sampled_from([(1, 1), (2, 1), (4, 2)]))
    d = draw(st.sampled_from([16, 32]))
    hidden = draw(st.sampled_from([16, 48]))
    inter = draw(st.sampled_from([8, 24]))
    n_layers, n_slots = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    t = draw(st.integers(1, n_slots))  # one row per slot, as a decode step has
    capacity = draw(st.integers(4, 90))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    biases = draw(st.booleans())
    qkv_n, q_size = (heads + 2 * kv_heads) * d, heads * d

    def w(*shape):
        return _bf16(rng.normal(size=shape) * 0.3)

    layers = [dict(input_norm=w(hidden), post_norm=w(hidden), qkv=w(qkv_n, hidden), o=w(hidden, q_size),
                   gate_up=w(2 * inter, hidden), down=w(hidden, inter),
                   qkv_bias=rng.normal(size=qkv_n).astype(np.float32) if biases else None,
                   o_bias=rng.normal(size=hidden).astype(np.float32) if biases else None)
              for _ in range(n_layers)]
    x = w(t, hidden)
    slots = rng.permutation(n_slots)[:t]
    positions = rng.integers(0, capacity, t).astype(np.int64)
    angles = np.outer(np.arange(capacity), rng.uniform(0.01, 1.0, d // 2))
    cos = _bf16(np.concatenate([np.cos(angles)] * 2, axis=1))
    sin = _bf16(np.concatenate([-np.sin(angles), np.sin(angles)], axis=1))
    k_cache = w(n_layers, n_slots, kv_heads, capacity, d)
    v_cache = w(n_layers, n_slots, kv_heads, capacity, d)
    window = draw(st.sampled_from([0, 0, 5]))
    return layers, heads, kv_heads, x, positions, slots.astype(np.int64), cos, sin, k_cache, v_cache, window


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@settings(max_examples=25, deadline=None)
@given(_problem())
def test_decode_layers_match_the_reference(kernel, problem):
    layers, heads, kv_heads, x, positions, slots, cos, sin, k_cache, v_cache, window = problem
    scale = 1 / np.sqrt(cos.shape[1])
    want = [x.copy(), k_cache.copy(), v_cache.copy()]
    got = [x.copy(), k_cache.copy(), v_cache.copy()]
    native_ref.bf16_decode_layers(layers, heads, kv_heads, 1e-5, want[0], positions, slots, cos, sin,
                                  want[1], want[2], window, scale)
    native.bf16_decode_layers(layers, heads, kv_heads, 1e-5, got[0], positions, slots, cos, sin,
                              got[1], got[2], window, scale, kernel=kernel)
    assert not np.array_equal(want[0], x)
    for g, w_ in zip(got, want):
        assert np.array_equal(g, w_)


def test_scratch_size_is_cs_rule():
    for args in ((1, 576, 9, 3, 64, 1536), (8, 2048, 16, 8, 128, 6144), (3, 16, 1, 1, 16, 8)):
        assert native.bf16_decode_scratch(*args) == native_ref.bf16_decode_scratch(*args) > 0
    assert native.bf16_decode_scratch(0, 576, 9, 3, 64, 1536) == 0


def test_too_small_a_scratch_is_refused():
    from mashbox.model import csrc
    import torch

    hidden, heads, kv_heads, d, inter = 16, 2, 1, 16, 8
    packed = lambda n, k: torch.zeros(csrc.packed_bytes(n, k) // 2, dtype=torch.int16)  # noqa: E731
    layer = dict(input_norm=torch.ones(hidden, dtype=torch.bfloat16), post_norm=torch.ones(hidden, dtype=torch.bfloat16),
                 qkv=packed((heads + 2 * kv_heads) * d, hidden), o=packed(hidden, heads * d),
                 gate_up=packed(2 * inter, hidden), down=packed(hidden, inter), qkv_bias=None, o_bias=None)
    table = csrc.LayerTable([layer], hidden, heads, kv_heads, d, inter)
    x = torch.zeros(2, hidden, dtype=torch.bfloat16)
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    cos = torch.ones(8, d, dtype=torch.bfloat16)
    cache = torch.zeros(1, 2, kv_heads, 8, d, dtype=torch.bfloat16)
    args = (x, i64(0, 1), i64(0, 1), i64(0, 1), i64(1, 2), 1e-5, cos, cos, cache, cache.clone(), 0, 0.25)
    need = table.scratch_elements(2)
    with pytest.raises(ValueError, match="scratch buffer too small"):
        table.decode(*args, torch.zeros(need - 1, dtype=torch.bfloat16), native.KERNEL_PORTABLE)
    table.decode(*args, torch.zeros(need, dtype=torch.bfloat16), native.KERNEL_PORTABLE)

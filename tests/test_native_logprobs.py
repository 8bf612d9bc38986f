"""Log probabilities in C (native.logprobs) against the reference (native_ref.logprobs)
and against torch.log_softmax: the chosen token's logprob and the top-N, ties by lower
id, -inf / NaN logits, and that they are taken after the penalties, before temperature."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mashbox import native, native_ref

F32 = np.float32


def _same(c, ref):
    """C vs reference: exact top ids, logprobs within float32 rounding of the float64 value."""
    lp_c, ids_c, top_c = c
    lp_r, ids_r, top_r = ref
    np.testing.assert_array_equal(ids_c, ids_r)
    np.testing.assert_allclose(lp_c, lp_r, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(top_c, top_r, rtol=1e-6, atol=1e-6)


# logits with ties (few distinct values), infinities and NaN
_values = st.one_of(
    st.floats(-50, 50, width=32),
    st.sampled_from([0.0, -0.0, 1.5, -1.5, float("-inf"), float("inf"), float("nan")]),
)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), rows=st.integers(0, 4), vocab=st.integers(1, 70))
def test_c_matches_the_reference(data, rows, vocab):
    logits = data.draw(hnp.arrays(F32, (rows, vocab), elements=_values))
    top_n = data.draw(st.integers(0, min(20, vocab)))
    ids = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=rows, max_size=rows)), np.int32)
    c = native.logprobs(logits, ids, top_n)
    ref = native_ref.logprobs(logits.copy(), ids, top_n)
    lp_c, ids_c, top_c = c
    assert lp_c.shape == (rows,) and ids_c.shape == top_c.shape == (rows, top_n)
    with np.errstate(invalid="ignore"):
        _same(c, ref)


def test_matches_torch_log_softmax():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((3, 49152)) * 4).astype(F32)
    ids = np.array([0, 17, 49151], np.int32)
    lp, top_ids, top_lp = native.logprobs(logits, ids, 20)
    want = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    np.testing.assert_allclose(lp, want[torch.arange(3), torch.from_numpy(ids).long()].numpy(), atol=1e-5)
    vals, idx = torch.topk(want, 20, dim=-1)
    np.testing.assert_array_equal(top_ids, idx.numpy())
    np.testing.assert_allclose(top_lp, vals.numpy(), atol=1e-5)
    assert np.all(np.diff(top_lp, axis=1) <= 0)
    assert np.all(np.exp(top_lp.astype(np.float64)).sum(axis=1) <= 1 + 1e-6)


def test_ties_go_to_the_lower_id_and_infinities():
    logits = np.array([[1, 3, 3, -np.inf, 3, np.nan], [-np.inf] * 6], F32)
    lp, top_ids, top_lp = native.logprobs(logits, np.array([1, 2], np.int32), 6)
    assert top_ids[0].tolist() == [1, 2, 4, 0, 3, 5]  # -inf and NaN last, by id
    assert top_lp[0, 3] < 0 and np.isneginf(top_lp[0, 4:]).all()
    np.testing.assert_allclose(lp[0], 3 - np.log(3 * np.exp(3.0) + np.exp(1.0)), rtol=1e-6)
    assert np.isneginf(lp[1]) and np.isneginf(top_lp[1]).all() and top_ids[1].tolist() == [0, 1, 2, 3, 4, 5]


def test_after_the_penalties_before_the_temperature():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((1, 300)) * 3).astype(F32)
    hist = np.array([5, 7, 7], np.int32)
    params = np.array([[0.7, 1.0, 0, 0.0, 1.3, 0.5, 0.2]], F32)  # temperature 0.7 and all three penalties
    want = logits.copy()
    native_ref.sample(want, params, np.array([native.rng_init(3)], np.uint64), hist,
                      np.array([0, 3], np.int32), np.array([1], np.int32))
    seen = logits.copy()
    tok = native.sample(seen, params, np.array([native.rng_init(3)], np.uint64), hist,
                        np.array([0, 3], np.int32), np.array([1], np.int32))
    np.testing.assert_array_equal(seen, want)  # the sampler penalised in place
    assert seen[0, 5] != logits[0, 5] and seen[0, 7] != logits[0, 7]
    lp, _, _ = native.logprobs(seen, tok, 0)
    ref = torch.log_softmax(torch.from_numpy(seen).double(), -1)[0, int(tok[0])].item()  # no / temperature
    assert abs(float(lp[0]) - ref) < 1e-5


def test_the_wrapper_checks_before_c():
    logits = np.zeros((2, 10), F32)
    with pytest.raises(ValueError, match="top_n"):
        native.logprobs(logits, np.zeros(2, np.int32), 21)
    with pytest.raises(ValueError, match="top_n"):
        native.logprobs(np.zeros((1, 3), F32), np.zeros(1, np.int32), 4)
    with pytest.raises(ValueError, match="ids"):
        native.logprobs(logits, np.array([0, 10], np.int32), 1)
    with pytest.raises(ValueError, match="ids must have shape"):
        native.logprobs(logits, np.zeros(3, np.int32), 1)
    assert native.MAX_TOP_LOGPROBS == 20

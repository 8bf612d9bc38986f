"""Constrained decoding's token bitmask in C (native.apply_token_bitmask) against its
reference (native_ref) bit for bit with hypothesis, against llguidance's own numpy
implementation of the same layout, and the wrapper's refusals before C sees an address."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mashbox import native, native_ref

F32 = np.float32


@st.composite
def _cases(draw):
    rows = draw(st.integers(0, 5))
    vocab = draw(st.integers(1, 200))
    # fewer words than the vocab needs (ids past them: never), exactly enough, or more
    words = draw(st.sampled_from([max(1, (vocab + 31) // 32 - 1), (vocab + 31) // 32, (vocab + 31) // 32 + 1]))
    mask_rows = draw(st.integers(1, 4))
    word = st.one_of(st.sampled_from([0, -1, 1, -2**31, 2**31 - 1]), st.integers(-2**31, 2**31 - 1))
    bitmask = draw(hnp.arrays(np.int32, (mask_rows, words), elements=word))
    logits = draw(hnp.arrays(F32, (rows, vocab), elements=st.floats(-50, 50, width=32)))
    row_mask = np.array(draw(st.lists(st.integers(-1, mask_rows - 1), min_size=rows, max_size=rows)), np.int32)
    return logits, bitmask, row_mask


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_c_equals_the_reference(case):
    logits, bitmask, row_mask = case
    a, b = logits.copy(), logits.copy()
    native.apply_token_bitmask(a, bitmask, row_mask)
    native_ref.apply_token_bitmask(b, bitmask.view(np.uint32), row_mask)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    for r, m in enumerate(row_mask.tolist()):
        if m < 0:  # an unconstrained row is left exactly as it was
            assert np.array_equal(a[r].view(np.uint32), logits[r].view(np.uint32))


def test_same_as_llguidance_numpy_apply():
    lln = pytest.importorskip("llguidance.numpy")
    rng = np.random.default_rng(3)
    vocab = 49152 + 7  # a padded vocabulary: the ids past the mask's words are never allowed
    bitmask = rng.integers(-2**31, 2**31, size=(3, 49152 // 32), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1
    bitmask[2, ::3] = 0
    logits = rng.standard_normal((3, vocab)).astype(F32)
    ours, theirs = logits.copy(), logits.copy()
    native.apply_token_bitmask(ours, bitmask, np.arange(3, dtype=np.int32))
    lln.apply_token_bitmask_inplace(theirs, bitmask)
    assert np.array_equal(ours, theirs)
    assert np.isinf(ours[1, 49152:]).all() and np.array_equal(ours[1, :49152], logits[1, :49152])


def test_rows_read_only_their_own_mask_row():
    logits = np.zeros((3, 64), F32)
    bitmask = np.array([[1, 0], [0, -2**31]], np.int32)  # row 0 allows id 0; row 1 id 63
    native.apply_token_bitmask(logits, bitmask, np.array([1, -1, 0], np.int32))
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [63]
    assert np.isfinite(logits[1]).all()
    assert np.flatnonzero(np.isfinite(logits[2])).tolist() == [0]


@pytest.mark.parametrize("logits, bitmask, row_mask, words", [
    (np.zeros((2, 40), F32), np.zeros((2, 2), np.int32), np.array([0], np.int32), "row_mask must have shape"),
    (np.zeros((1, 40), F32), np.zeros((2, 2), np.int32), np.array([2], np.int32), "row_mask entries"),
    (np.zeros((1, 40), F32), np.zeros((2, 2), np.int32), np.array([-2], np.int32), "row_mask entries"),
    (np.zeros((1, 40), F32), np.zeros((2, 2), np.int64), np.array([0], np.int32), "bitmask must be"),
    (np.zeros((1, 40), F32), np.zeros(4, np.int32), np.array([0], np.int32), "bitmask must be"),
    (np.zeros((1, 40), F32), np.zeros((2, 0), np.int32), np.array([0], np.int32), "at least one word"),
    (np.zeros((1, 40), np.float64), np.zeros((2, 2), np.int32), np.array([0], np.int32), "logits must be"),
    (np.zeros((40, 2), F32).T, np.zeros((2, 2), np.int32), np.array([0, 0], np.int32), "logits must be"),
])
def test_the_wrapper_refuses_bad_arguments(logits, bitmask, row_mask, words):
    with pytest.raises(ValueError, match=words):
        native.apply_token_bitmask(logits, bitmask, row_mask)

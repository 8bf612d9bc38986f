"""Prefix-cache block hashes and lookup: C against the reference, and what the prefix
cache relies on (a hash covers its whole prefix; the longest match wins)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mashbox import native, native_ref

_ids = hnp.arrays(np.int32, st.integers(0, 200), elements=st.integers(-(2**31), 2**31 - 1))


@settings(max_examples=300, deadline=None)
@given(_ids, st.integers(1, 17))
def test_block_hashes_match_the_reference(ids, block):
    c = native.block_hashes(ids, block)
    assert c.dtype == np.uint64 and len(c) == len(ids) // block
    assert c.tolist() == native_ref.block_hashes(ids, block).tolist()


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.int32, st.integers(8, 120), elements=st.integers(0, 50)), st.integers(1, 8), st.data())
def test_a_hash_covers_its_whole_prefix_and_nothing_after(ids, block, data):
    full = native.block_hashes(ids, block)
    k = data.draw(st.integers(0, len(ids)))
    assert native.block_hashes(ids[:k], block).tolist() == full[: k // block].tolist()
    pos = data.draw(st.integers(0, len(ids) - 1))
    changed = ids.copy()
    changed[pos] += 1
    other = native.block_hashes(changed, block)
    first = pos // block  # blocks before it keep their hash, it and all later ones change
    assert other[:first].tolist() == full[:first].tolist()
    assert all(a != b for a, b in zip(other[first:], full[first:]))


def test_hash_values_are_pinned():
    # a change of the hash function must be deliberate: C, reference and this line together
    h = native.block_hashes(np.arange(8, dtype=np.int32), 4)
    assert h.tolist() == [13399284200620666048, 7317397482135369157]


@st.composite
def _tables(draw):
    """A prompt's hashes and a table of slots sharing random prefixes with it."""
    block = 2
    prompt = np.array(draw(st.lists(st.integers(0, 5), min_size=0, max_size=24)), np.int32)
    slots = draw(st.integers(0, 6))
    max_blocks = draw(st.integers(0, 14))
    table = np.zeros((slots, max_blocks), np.uint64)
    counts = np.zeros(slots, np.int32)
    for s in range(slots):
        keep = draw(st.integers(0, len(prompt)))
        tail = draw(st.lists(st.integers(0, 5), max_size=10))
        hashes = native.block_hashes(np.concatenate([prompt[:keep], np.array(tail, np.int32)]), block)
        n = min(len(hashes), max_blocks)
        table[s, :n] = hashes[:n]
        counts[s] = draw(st.integers(-1, max_blocks + 1)) if draw(st.booleans()) else n
    usable = np.array(draw(st.lists(st.booleans(), min_size=slots, max_size=slots)), bool)
    return native.block_hashes(prompt, block), table, counts, usable


@settings(max_examples=400, deadline=None)
@given(_tables())
def test_longest_prefix_matches_the_reference(case):
    query, table, counts, usable = case
    assert native.longest_prefix(query, table, counts, usable) == native_ref.longest_prefix(query, table, counts, usable)


def test_longest_prefix_picks_the_longest_usable_match():
    block = 4
    prompt = np.arange(40, dtype=np.int32)
    other = np.arange(100, 140, dtype=np.int32)
    rows = [
        native.block_hashes(prompt[:12], block),  # 3 blocks in common
        native.block_hashes(np.concatenate([prompt[:28], other[:8]]), block),  # 7 in common
        native.block_hashes(prompt, block),  # all 10, but the slot is busy
        native.block_hashes(other, block),  # none
    ]
    table = np.zeros((4, 12), np.uint64)
    counts = np.zeros(4, np.int32)
    for s, h in enumerate(rows):
        table[s, : len(h)] = h
        counts[s] = len(h)
    query = native.block_hashes(prompt, block)
    usable = np.array([1, 1, 0, 1], np.uint8)
    assert native.longest_prefix(query, table, counts, usable) == (1, 7)
    usable[2] = 1
    assert native.longest_prefix(query, table, counts, usable) == (2, 10)
    # counts bound the match: hashes past a slot's count are stale
    counts[2] = 5
    assert native.longest_prefix(query, table, counts, usable) == (1, 7)
    # nothing in common: the usable slot with the fewest cached blocks (worth least)
    assert native.longest_prefix(native.block_hashes(other[::-1].copy(), block), table, counts, usable) == (0, 0)
    assert native.longest_prefix(query, table, counts, np.zeros(4, bool)) == (-1, 0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="block"):
        native.block_hashes(np.arange(4), 0)
    with pytest.raises(ValueError, match="counts"):
        native.longest_prefix(np.zeros(1, np.uint64), np.zeros((2, 3), np.uint64), np.zeros(3, np.int32), np.ones(2, bool))

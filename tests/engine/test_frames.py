"""The pipe codec: any split of the byte stream gives back the same frames."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mashbox.config import StepEvent, Timings
from mashbox.engine import frames

objs = st.lists(
    st.dictionaries(st.text(max_size=5), st.one_of(st.integers(-(2**40), 2**40), st.text(max_size=20),
                                                    st.lists(st.integers(0, 2**31 - 1), max_size=8)),
                    max_size=4),
    min_size=1, max_size=6,
)


@given(objs, st.lists(st.integers(1, 50), min_size=1, max_size=30))
def test_any_split_round_trips(items, cuts):
    data = b"".join(frames.encode(o) for o in items)
    r = frames.FrameReader()
    got, pos, i = [], 0, 0
    while pos < len(data):
        n = cuts[i % len(cuts)]
        got.extend(r.feed(data[pos : pos + n]))
        pos += n
        i += 1
    assert got == items and r.pending_bytes == 0


def test_step_event_round_trip():
    ev = StepEvent(id="r1", token_ids=(1, 2), text="hé", finish_reason="length",
                   timings=Timings(queue_ms=1.5, prompt_n=3), started=True)
    (back,) = frames.FrameReader().feed(frames.encode(ev.to_wire()))
    assert StepEvent.from_wire(back) == ev


def test_absurd_length_is_an_error():
    with pytest.raises(frames.FrameError):
        frames.FrameReader().feed(b"\xff\xff\xff\xff{}")

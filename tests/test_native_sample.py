"""Sampling in C (mashbox.native) against its reference (mashbox.native_ref) and against
what sampling means: bit-exact parity with hypothesis, then independent checks of greedy,
penalties, filters and the draw's distribution, and of per-row seeds."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mashbox import native, native_ref

F32 = np.float32


def _no_history(rows: int):
    return np.zeros(0, np.int32), np.zeros(rows + 1, np.int32), np.zeros(rows, np.int32)


def _params(rows: int, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, rep=1.0, freq=0.0, pres=0.0):
    return np.tile(np.array([temperature, top_p, top_k, min_p, rep, freq, pres], F32), (rows, 1))


def _states(seeds) -> np.ndarray:
    return np.array([native.rng_init(s) for s in seeds], dtype=np.uint64)


def test_the_c_extension_is_loaded():
    assert native.NATIVE is True


def test_rng_is_splitmix64():
    # Vigna's splitmix64.c from state 1234567 (public test vector)
    state = np.array([1234567], dtype=np.uint64)
    draws = [int(native.rng_next(state)[0]) for _ in range(3)]
    assert draws == [6457827717110365317, 3203168211198807973, 9817491932198370423]
    assert native.rng_init(7) == native_ref.rng_init(7)
    assert native.rng_init(-1) == native_ref.rng_init(2**64 - 1)
    assert native.rng_init(1) != native.rng_init(2)


# -- parity --------------------------------------------------------------------------

_logit = st.one_of(
    st.floats(-40, 40, width=32),
    st.sampled_from([0.0, -0.0, 1.0, 2.5, -np.inf, np.nan]),  # ties, signed zero, masks
)
_param_rows = st.tuples(
    st.sampled_from([0.0, 0.0, 0.1, 0.7, 1.0, 2.0, 4.0, np.float32(1e-30)]),  # temperature
    st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.1, 1e-6]),  # top_p
    st.sampled_from([0, 0, 1, 2, 3, 10, 50, 1e9]),  # top_k
    st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.5, 0.99]),  # min_p
    st.sampled_from([1.0, 1.0, 1.2, 0.8, 2.0]),  # repetition
    st.sampled_from([0.0, 0.0, 0.5, -1.0, 2.0]),  # frequency
    st.sampled_from([0.0, 0.0, 0.7, -2.0]),  # presence
)


@st.composite
def _batches(draw):
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 300))
    logits = draw(hnp.arrays(F32, (rows, vocab), elements=_logit))
    params = np.array([draw(_param_rows) for _ in range(rows)], dtype=F32)
    lengths = [draw(st.integers(0, 40)) for _ in range(rows)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(offsets[-1])
    hist = np.array(draw(st.lists(st.integers(-3, vocab + 3), min_size=total, max_size=total)), np.int32)
    gen_start = np.array([draw(st.integers(-2, n + 2)) for n in lengths], np.int32)
    seeds = [draw(st.integers(0, 2**64 - 1)) for _ in range(rows)]
    return logits, params, hist, offsets, gen_start, seeds


def _both(logits, params, hist, offsets, gen_start, seeds):
    """Run C and reference on copies; return both (tokens, states, penalised logits)."""
    out = []
    for impl in (native, native_ref):
        x, state = logits.copy(), _states(seeds)
        tokens = impl.sample(x, params, state, hist, offsets, gen_start)
        out.append((tokens, state, x))
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_c_matches_reference_bit_for_bit(batch):
    (tc, sc, xc), (tr, sr, xr) = _both(*batch)
    assert tc.tolist() == tr.tolist()
    assert sc.tolist() == sr.tolist()
    assert xc.view(np.uint32).tolist() == xr.view(np.uint32).tolist()  # penalties, NaN -> -inf


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=40),
        dict(temperature=4.0, top_p=0.95),
        dict(temperature=1.5, min_p=0.05),
        dict(temperature=0.8, top_k=100, top_p=0.8, min_p=0.02, rep=1.1, freq=0.3, pres=0.2),
    ],
)
@pytest.mark.parametrize("shape", ["normal", "plateau"])
def test_c_matches_reference_at_real_vocab_size(params, shape):
    rng = np.random.default_rng(1)
    rows, vocab = 4, 49152
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(F32)
    logits[:, :40] = 12.0  # a tie block at the top, so top_k and top_p cut through ties
    if shape == "plateau":  # thousands of near-equal tokens: top_p's cut bucket is large
        logits[:, 500:4500] = 12.0 + rng.uniform(-0.05, 0.0, (rows, 4000)).astype(F32)
    hist = rng.integers(0, vocab, 200).astype(np.int32)
    offsets = np.array([0, 50, 100, 150, 200], np.int32)
    gen_start = np.array([10, 0, 50, 25], np.int32)
    for seed in range(5):
        seeds = [seed * 10 + r for r in range(rows)]
        (tc, sc, xc), (tr, sr, xr) = _both(logits, _params(rows, **params), hist, offsets, gen_start, seeds)
        assert tc.tolist() == tr.tolist()
        assert sc.tolist() == sr.tolist()
        assert np.array_equal(xc, xr)


# -- greedy and penalties, checked against their definitions -----------------------------


def test_greedy_takes_the_lowest_id_among_ties_and_ignores_nan():
    logits = np.array([[1.0, 3.0, np.nan, 3.0, 2.0], [np.nan, -np.inf, -1.0, -1.0, -5.0]], F32)
    tokens = native.sample(logits, _params(2), _states([0, 1]), *_no_history(2))
    assert tokens.tolist() == [1, 2]
    assert np.isneginf(logits[0, 2]) and np.isneginf(logits[1, 0])


def test_every_row_takes_one_draw_greedy_rows_too():
    state = _states([5, 6])
    before = state.copy()
    native.sample(np.zeros((2, 8), F32), _params(2), state, *_no_history(2))
    expected = before.copy()
    native.rng_next(expected)
    assert state.tolist() == expected.tolist()


def test_repetition_penalty_follows_hf_over_prompt_and_output():
    logits = np.array([[2.0, -2.0, 4.0, -1.0, 0.5]], F32)
    hist = np.array([0, 1, 1, 3, 99, -1], np.int32)  # repeated and out-of-range ids too
    offsets = np.array([0, 6], np.int32)
    native.sample(logits, _params(1, rep=2.0), _states([0]), hist, offsets, np.array([2], np.int32))
    assert logits[0].tolist() == [1.0, -4.0, 4.0, -2.0, 0.5]  # once per id: >0 divided, else times


def test_frequency_and_presence_follow_openai_over_generated_ids_only():
    logits = np.zeros((1, 6), F32)
    hist = np.array([4, 5, 1, 1, 1, 2], np.int32)  # prompt [4, 5], generated [1, 1, 1, 2]
    offsets = np.array([0, 6], np.int32)
    native.sample(logits, _params(1, freq=0.5, pres=0.25), _states([0]), hist, offsets, np.array([2], np.int32))
    assert logits[0].tolist() == [0.0, -1.75, -0.75, 0.0, 0.0, 0.0]


def test_penalties_change_the_greedy_choice():
    logits = np.array([[5.0, 4.0, 0.0]], F32)
    hist = np.array([0], np.int32)
    tok = native.sample(logits, _params(1, rep=2.0), _states([0]), hist, np.array([0, 1], np.int32), np.array([0], np.int32))
    assert tok.tolist() == [1]  # 5 / 2 < 4


# -- the draw ----------------------------------------------------------------------------


def _draw_many(logits_row, n: int, **params) -> np.ndarray:
    """n draws of one distribution: n rows with seeds 0..n-1, in one call."""
    logits = np.tile(np.asarray(logits_row, F32), (n, 1))
    return native.sample(logits, _params(n, **params), _states(range(n)), *_no_history(n))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_softmax_of_logits_over_temperature(temperature):
    logits = np.array([2.0, 1.0, 0.0, -1.0, 0.5, 3.0], np.float64)
    n = 30000
    counts = np.bincount(_draw_many(logits, n, temperature=temperature), minlength=6)
    expected = n * _softmax(logits / temperature)
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected) + 1), (counts, expected)


def test_top_k_draws_only_the_k_best_and_in_proportion():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(500) * 2
    n = 20000
    tokens = _draw_many(logits, n, temperature=1.5, top_k=5)
    best5 = np.argsort(-logits)[:5]
    assert set(tokens.tolist()) <= set(best5.tolist())
    counts = np.bincount(tokens, minlength=500)[best5]
    expected = n * _softmax(logits[best5] / 1.5)
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected) + 1)


def test_top_p_draws_only_the_nucleus():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal(2000) * 3
    p = _softmax(logits)
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    nucleus = order[: int(np.searchsorted(cum, 0.9)) + 1]  # smallest prefix reaching 0.9
    assert cum[len(nucleus) - 1] - 0.9 > 1e-6 and 0.9 - (cum[len(nucleus) - 2]) > 1e-6  # clear cut
    tokens = _draw_many(logits, 20000, temperature=1.0, top_p=0.9)
    assert set(tokens.tolist()) <= set(nucleus.tolist())
    assert len(set(tokens.tolist())) > len(nucleus) // 2  # and it is not just greedy


def test_min_p_draws_only_tokens_above_min_p_times_the_top():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(1000) * 2
    p = _softmax(logits)
    tokens = _draw_many(logits, 20000, temperature=1.0, min_p=0.2)
    assert np.all(p[tokens] >= 0.2 * p.max() * (1 - 1e-9))
    assert len(set(tokens.tolist())) > 1


def test_masked_tokens_are_never_drawn():
    logits = np.full(100, -np.inf)
    logits[[3, 50, 97]] = [0.0, 0.1, -0.2]
    tokens = _draw_many(logits, 3000, temperature=4.0)
    assert set(tokens.tolist()) == {3, 50, 97}


def test_top_k_one_and_tiny_temperature_are_greedy():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal(300)
    best = int(np.argmax(logits))
    assert set(_draw_many(logits, 500, temperature=2.0, top_k=1).tolist()) == {best}
    assert set(_draw_many(logits, 500, temperature=1e-6).tolist()) == {best}


# -- seeds ------------------------------------------------------------------------------


def test_a_rows_tokens_depend_on_its_own_seed_alone():
    rng = np.random.default_rng(7)
    vocab = 1000
    mine = (rng.standard_normal(vocab) * 2).astype(F32)
    params = [1.0, 0.95, 0, 0.0, 1.1, 0.0, 0.0]

    def run(batch_logits, batch_params, seeds, steps=20):
        state = _states(seeds)
        out = []
        for _ in range(steps):
            out.append(native.sample(batch_logits.copy(), batch_params, state, *_no_history(len(seeds))))
        return np.array(out)  # [steps, rows]

    alone = run(mine[None, :], np.array([params], F32), [42])[:, 0]
    others = (rng.standard_normal((3, vocab)) * 5).astype(F32)
    batch = np.concatenate([others[:1], mine[None, :], others[1:]])
    batch_params = np.array([[0.7, 0.5, 10, 0, 1, 0, 0], params, [2.0, 1, 0, 0.1, 1, 0, 0], [0, 1, 0, 0, 1, 0, 0]], F32)
    beside = run(batch, batch_params, [1, 42, 2, 3])[:, 1]
    assert alone.tolist() == beside.tolist()
    assert len(set(alone.tolist())) > 1  # the row really samples
    assert run(mine[None, :], np.array([params], F32), [43])[:, 0].tolist() != alone.tolist()


# -- arguments ---------------------------------------------------------------------------


def test_bad_arguments_raise_value_errors_naming_the_argument():
    logits = np.zeros((2, 10), F32)
    hist, offsets, gen = _no_history(2)
    with pytest.raises(ValueError, match="params"):
        native.sample(logits, np.zeros((2, 6), F32), _states([0, 1]), hist, offsets, gen)
    with pytest.raises(ValueError, match="rng_state"):
        native.sample(logits, _params(2), np.zeros(2, np.int64), hist, offsets, gen)
    with pytest.raises(ValueError, match="hist_offsets"):
        native.sample(logits, _params(2), _states([0, 1]), hist, np.array([0, 5, 5], np.int32), gen)
    with pytest.raises(ValueError, match="hist_offsets"):
        native.sample(logits, _params(2), _states([0, 1]), np.zeros(4, np.int32), np.array([0, 3, 1], np.int32), gen)
    with pytest.raises(ValueError, match="logits"):
        native.sample(np.zeros(10, F32), _params(1), _states([0]), *_no_history(1))


def test_non_float32_logits_are_copied_not_rejected():
    logits = np.array([[0.0, 1.0, 0.5]], np.float64)
    assert native.sample(logits, _params(1), _states([0]), *_no_history(1)).tolist() == [1]


def test_without_the_extension_the_reference_is_used_with_a_warning():
    """A fresh interpreter where mashbox._native cannot be imported (as when it was never
    built): native falls back to native_ref, says so, and gives the same answers."""
    code = r"""
import logging, sys
import numpy as np
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s %(message)s")
sys.modules["mashbox._native"] = None  # makes `import mashbox._native` raise ImportError
from mashbox import native
assert native.NATIVE is False
logits = np.array([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]], np.float32)
params = np.zeros((2, 7), np.float32); params[:, 4] = 1.0; params[1, 0] = 1.0
state = np.array([native.rng_init(1), native.rng_init(2)], np.uint64)
print("tokens", native.sample(logits, params, state, np.zeros(0, np.int32), np.zeros(3, np.int32), np.zeros(2, np.int32)).tolist())
print("state", state.tolist())
m = native.StopMatcher(["ab"])
print("stop", m.feed("xa"), m.feed("bc"))
print("hash", native.block_hashes(np.arange(8, dtype=np.int32), 4).tolist())
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mashbox.native mashbox._native is not built" in out.stdout
    logits = np.array([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]], F32)
    params = _params(2, rep=1.0)
    params[1, 0] = 1.0
    state = _states([1, 2])
    tokens = native.sample(logits, params, state, *_no_history(2))
    assert f"tokens {tokens.tolist()}" in out.stdout
    assert f"state {state.tolist()}" in out.stdout
    assert "stop ('x', -1) ('', 0)" in out.stdout
    assert "hash [13399284200620666048, 7317397482135369157]" in out.stdout

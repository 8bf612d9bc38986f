"""Pure numpy/Python reference of the C extension (csrc/): the definition it must match.

Over ~450 lines on purpose: one twin of every C function in one module, as csrc/mashbox.h
is the one C API and native.py its one wrapper; split, the rules below would be split too.

Everything here is written for exactness, not speed: the C code (csrc/sample.c, stop.c,
prefix.c) must give the same bits, and the parity tests check that it does. The rules
both follow:

RNG. One 64-bit state per row, advanced by splitmix64 (state += 0x9E3779B97F4A7C15,
output = mix64(state)). `rng_init(seed)` = mix64(seed + 0x9E3779B97F4A7C15) mod 2**64,
so nearby seeds start far apart. Every sampled token takes exactly one draw from its own
row's state (greedy rows included), so a row's tokens depend on its seed alone.

Sampling, per row, on the float32 logits x (modified in place):
  1. Repetition penalty (HF): each distinct id of the whole history once,
     x = x / rp if x > 0 else x * rp (float32).
     Frequency / presence (OpenAI): each distinct generated id once with its count c,
     x = (x - float32(c) * fp) - pp (float32). NaN logits then become -inf.
  2. temperature <= 0: argmax, lowest id on ties.
  3. d = (double(x) - double(max x)) * (1 / double(temperature)); weights
     w = exp(d) by our own polynomial (`_weights`, the same float64 operations in C, so
     the bits agree; libm and numpy's SIMD exp do not agree to the last bit), and the
     integer weight W = round(w * 2**44), ties to even (0 when d < -40 or not a number;
     tokens below about exp(-31.2) of the top one thus weigh 0 and are never drawn). All later steps work
     on the integer W, whose sums are exact in any order.
  4. top_k (1 <= k < tokens with W > 0): keep the k first tokens in the order
     (x descending, id ascending) -- `_order_keys`.
  5. top_p (< 1): S = sum W, P = double(top_p) * double(S); walking the same order,
     a token is kept iff double(sum of W before it) < P (so the first is always kept).
  6. min_p (> 0): keep iff double(W) >= double(min_p) * 2**44 (the top token has
     W = 2**44).
  7. One draw z; target = (z * S) >> 64 with S = sum of the kept W (exact 128-bit
     product); the token is the first id, in id order, whose running sum of W exceeds
     target. S == 0 (no finite logit) falls back to the argmax.

Stop strings: the stream stops at the first position where any stop string ends; among
the stops ending there the one starting earliest (the longest) wins, then the lowest
index. Text that cannot be part of a future match is emitted at once; the longest
suffix that is a proper prefix of some stop is held back. Empty stops are ignored.

Prefix hashes: h starts at 0xCBF29CE484222325; for every id (as uint32) in order,
h = mix64(h + 0x9E3779B97F4A7C15 + id); the hash of block i is h after its last id, so
it covers ids[:(i+1)*block] and chains every earlier block. `longest_prefix` takes the
usable slot with the most leading equal hashes; ties go to the slot with fewer cached
blocks (its cache is worth least), then to the lowest slot index.

bfloat16 linear layers (`bf16_linear`; csrc/linear.c): y[r, c] = x[r] . w[c] (+ bias[c])
on bfloat16 bits. Each output is one float32 accumulator, starting at +0, walking the
input pairs p = 0, 1, ... in order: acc = acc + x[2p+1] * w[2p+1], then
acc = acc + x[2p] * w[2p] (a product of two bfloat16 is exact in float32; every add
rounds to nearest even; denormal inputs and sums are zero, as AVX512-BF16's vdpbf16ps
does). Outside the rule, since the hardware treats them in its own way (a wider
exponent for the even product): products that leave float32's normal range (underflow
or overflow), and the sign of a zero sum. Weights and activations of real models are
far from both. Then acc + bias (float32), and bfloat16 output rounds that once to
nearest even (a denormal becomes zero, NaN stays NaN). Nothing depends on other rows.

Decode attention (`bf16_attention`; csrc/attention.c states the rule): per query head,
float32 dot products in 16 lanes, an online softmax over blocks of 64 keys with our own
exp (`att_exp`, float32 operations that numpy and C both round alike), the output
rounded once to bfloat16. A row depends on its own query, keys and end only.
The MLP's activation (`bf16_silu_mul`) takes the same exp.

Prefill attention (`bf16_prefill_attention`; csrc/attention.c states the rule): causal,
per query head, dot products of bfloat16 pairs summed as vdpbf16ps does (as the
linears'), scores in base 2 (scale * log2 e), an online softmax over blocks of 64 keys
from key 0 with a 2^x accurate to bfloat16 (`pf_exp2`, its own: cheaper than att_exp),
each probability rounded to bfloat16 before it weighs its value and joins the sum
(vdpbf16ps again). A query depends on its own vector, keys and position only.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
HASH_SEED = 0xCBF29CE484222325
NUM_PARAMS = 7  # temperature, top_p, top_k, min_p, repetition, frequency, presence
MAX_VOCAB = 1 << 19
W_SCALE = 2.0**44  # integer weight of the top token; sums stay < 2**63 for vocab < 2**19
D_MIN = -40.0  # below this, a token's weight is 0 (it would round to 0 anyway)

# exp(d) for d in [-40, 0]: d = n*ln2 + r with |r| <= ln2/2, exp(r) by a degree-10 Taylor
# polynomial (Horner, relative error < 3e-13, far below what sampling can tell), times
# 2**n. Rounding to the nearest n uses the 1.5*2**52 trick so C and numpy need no
# rint/floor of their own.
_LOG2E = 1.4426950408889634
_LN2_HI = 0.6931471803691238  # high bits of ln 2 (n * _LN2_HI is exact for |n| < 2**11)
_LN2_LO = 1.9082149292705877e-10
_ROUND = 6755399441055744.0  # 1.5 * 2**52
_INT_MAGIC = 4503599627370496.0  # 2**52: adding it rounds [0, 2**52) to an integer
_EXP_COEFFS = (  # 1/10!, 1/9!, ..., 1/1!, 1/0! as the C file spells them
    2.755731922398589e-07,
    2.7557319223985893e-06,
    2.48015873015873e-05,
    0.0001984126984126984,
    0.001388888888888889,
    0.008333333333333333,
    0.041666666666666664,
    0.16666666666666666,
    0.5,
    1.0,
    1.0,
)


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def rng_init(seed: int) -> int:
    """The 64-bit splitmix64 state for a seed (any Python int; taken mod 2**64)."""
    return _mix64((int(seed) + GOLDEN) & MASK64)


def _rng_next(state: int) -> tuple[int, int]:
    state = (state + GOLDEN) & MASK64
    return state, _mix64(state)


def rng_next(rng_state: np.ndarray) -> np.ndarray:
    """One raw 64-bit draw per row; rng_state: uint64[rows], advanced in place."""
    out = np.empty(len(rng_state), dtype=np.uint64)
    for r in range(len(rng_state)):
        s, z = _rng_next(int(rng_state[r]))
        rng_state[r] = s
        out[r] = z
    return out


def _weights(x: np.ndarray, xmax: float, temperature: float) -> np.ndarray:
    """int64[V] weights round(exp(d) * 2**44), d = (x - xmax) * (1/t), 0 where d < D_MIN or
    NaN; bit-identical to weights() in csrc/sample.c (same float64 operations)."""
    with np.errstate(all="ignore"):
        d = (x.astype(np.float64) - xmax) * (1.0 / temperature)
        keep = d >= D_MIN  # False for NaN (inf - inf)
        d = np.where(keep, d, 0.0)
        n = (d * _LOG2E + _ROUND) - _ROUND
        r = (d - n * _LN2_HI) - n * _LN2_LO
        p = np.full_like(d, _EXP_COEFFS[0])
        for c in _EXP_COEFFS[1:]:
            p = p * r + c
        v = p * np.ldexp(1.0, n.astype(np.int64)) * W_SCALE + _INT_MAGIC  # rounds, ties even
    w = v.view(np.int64) - np.int64(0x4330000000000000)
    return np.where(keep, w, 0)


def _order_keys(x: np.ndarray) -> np.ndarray:
    """uint64 keys whose ascending order is (x descending, id ascending); x float32[V]."""
    u = (x + np.float32(0.0)).view(np.uint32).astype(np.uint64)  # + 0 turns -0.0 into +0.0
    neg = (u & 0x80000000) != 0
    ordered = np.where(neg, (~u) & 0xFFFFFFFF, u | 0x80000000)  # ascending in x
    return (((~ordered) & 0xFFFFFFFF) << np.uint64(32)) | np.arange(len(x), dtype=np.uint64)


def _argmax(x: np.ndarray) -> int:
    return int(np.argmax(x))  # first maximum: lowest id on ties; x has no NaN here


def _penalize(x: np.ndarray, hist: np.ndarray, gen_start: int, rp, fp, pp) -> None:
    vocab = len(x)
    if rp != np.float32(1.0):
        ids = np.unique(hist[(hist >= 0) & (hist < vocab)])
        v = x[ids]
        x[ids] = np.where(v > 0, v / rp, v * rp)
    if fp != np.float32(0.0) or pp != np.float32(0.0):
        gen = hist[min(max(gen_start, 0), len(hist)):]
        ids, counts = np.unique(gen[(gen >= 0) & (gen < vocab)], return_counts=True)
        x[ids] = x[ids] - counts.astype(np.float32) * fp - pp


def _sample_row(x: np.ndarray, p: np.ndarray, state: int, hist: np.ndarray, gen_start: int):
    temperature, top_p, top_k, min_p, rp, fp, pp = (np.float32(v) for v in p)
    vocab = len(x)
    _penalize(x, hist, gen_start, rp, fp, pp)
    x[np.isnan(x)] = -np.inf
    state, z = _rng_next(state)
    if not temperature > 0:
        return _argmax(x), state
    weights = _weights(x, float(np.max(x)), float(temperature))  # [V] int64, >= 0
    pos = np.flatnonzero(weights > 0)
    if top_k >= 1 and top_k < vocab and int(top_k) < len(pos):
        keys = _order_keys(x)
        ranked = pos[np.argsort(keys[pos], kind="stable")]
        weights[ranked[int(top_k):]] = 0
        pos = np.flatnonzero(weights > 0)
    if top_p < 1 and len(pos):
        total = int(weights[pos].sum())
        threshold = float(top_p) * float(total)
        keys = _order_keys(x)
        ranked = pos[np.argsort(keys[pos], kind="stable")]
        w_ranked = weights[ranked]
        before = np.cumsum(w_ranked) - w_ranked  # exact int64
        weights[ranked[~(before.astype(np.float64) < threshold)]] = 0
    if min_p > 0:
        weights[weights.astype(np.float64) < float(min_p) * W_SCALE] = 0
    total = int(weights.sum())
    if total == 0:
        return _argmax(x), state
    target = (z * total) >> 64
    running = np.cumsum(weights)
    return int(np.searchsorted(running, target, side="right")), state


def sample(
    logits: np.ndarray,
    params: np.ndarray,
    rng_state: np.ndarray,
    hist_ids: np.ndarray,
    hist_offsets: np.ndarray,
    hist_gen_start: np.ndarray,
) -> np.ndarray:
    """One token per row; see the module rules. logits float32[rows, vocab] (penalised
    in place), params float32[rows, 7], rng_state uint64[rows] (advanced in place),
    hist_ids int32[n], hist_offsets int32[rows+1], hist_gen_start int32[rows]."""
    rows = logits.shape[0]
    out = np.empty(rows, dtype=np.int32)
    for r in range(rows):
        hist = hist_ids[int(hist_offsets[r]) : int(hist_offsets[r + 1])]
        tok, state = _sample_row(logits[r], params[r], int(rng_state[r]), hist, int(hist_gen_start[r]))
        out[r] = tok
        rng_state[r] = state
    return out


MAX_TOP_LOGPROBS = 20


def logprobs(logits: np.ndarray, ids: np.ndarray, top_n: int):
    """Log probabilities per row of the logits as `sample` left them (penalised, NaN ->
    -inf, before temperature): lse = max + log(sum exp(x - max)) in float64, logprob =
    float32(x - lse), -inf for -inf / NaN logits (and everywhere in a row with no finite
    logit). Returns (float32[rows] the chosen ids' logprobs, int32[rows, top_n] the best
    ids in (x descending, id ascending) order, float32[rows, top_n] their logprobs)."""
    rows, vocab = logits.shape
    out = np.empty(rows, dtype=np.float32)
    top_ids = np.empty((rows, top_n), dtype=np.int32)
    top_lp = np.empty((rows, top_n), dtype=np.float32)
    for r in range(rows):
        x = logits[r].astype(np.float64)
        x[np.isnan(x)] = -np.inf
        xmax = float(np.max(x))
        finite = x > -np.inf
        with np.errstate(invalid="ignore"):  # a +inf logit: inf - inf, lse NaN, all -inf as in C
            lse = xmax + float(np.log(np.sum(np.exp(x[finite] - xmax)))) if xmax > -np.inf else -np.inf
        lp = np.where(finite, x - lse, -np.inf) if lse > -np.inf else np.full(vocab, -np.inf)
        out[r] = np.float32(lp[int(ids[r])])
        order = np.argsort(_order_keys(x.astype(np.float32)), kind="stable")[:top_n]
        top_ids[r] = order
        top_lp[r] = lp[order].astype(np.float32)
    return out, top_ids, top_lp


class StopMatcher:
    """Incremental stop-string matching with hold-back, on str (see the module rules)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._live = [(i, s) for i, s in enumerate(self.stops) if s]
        self._held = ""
        self.matched = -1

    def feed(self, text: str) -> tuple[str, int]:
        if self.matched >= 0:
            return "", self.matched
        buf = self._held + text
        for end in range(len(self._held) + 1, len(buf) + 1):
            best = None  # (start, index)
            for i, s in self._live:
                start = end - len(s)
                if start >= 0 and buf.startswith(s, start):
                    if best is None or start < best[0]:
                        best = (start, i)
            if best is not None:
                self._held = ""
                self.matched = best[1]
                return buf[: best[0]], best[1]
        hold = 0
        for n in range(min(len(buf), max((len(s) for _, s in self._live), default=0)), 0, -1):
            if any(len(s) > n and s.startswith(buf[len(buf) - n :]) for _, s in self._live):
                hold = n
                break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], -1

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray, row_mask: np.ndarray) -> None:
    """Constrained decoding's mask (csrc/mask.c), in place on float32[rows, vocab] logits:
    row r with row_mask[r] >= 0 keeps logits[r, t] only where bit t % 32 of
    bitmask[row_mask[r], t // 32] (uint32[mask_rows, words], llguidance's layout) is set;
    every other id, those from words * 32 on too, becomes -inf. row_mask[r] == -1: the
    row is untouched."""
    vocab = logits.shape[1]
    words = bitmask.shape[1]
    for r, m in enumerate(row_mask.tolist()):
        if m < 0:
            continue
        for t in range(vocab):
            w = t // 32
            if w >= words or not (int(bitmask[m, w]) >> (t % 32)) & 1:
                logits[r, t] = -np.inf


def block_hashes(ids: np.ndarray, block: int) -> np.ndarray:
    """uint64[len(ids) // block]: hash i covers ids[: (i+1)*block]."""
    if block < 1:
        raise ValueError("block must be >= 1")
    n = len(ids) // block
    out = np.empty(n, dtype=np.uint64)
    h = HASH_SEED
    for i in range(n):
        for t in ids[i * block : (i + 1) * block]:
            h = _mix64((h + GOLDEN + (int(t) & 0xFFFFFFFF)) & MASK64)
        out[i] = h
    return out


def longest_prefix(
    query: np.ndarray, table: np.ndarray, counts: np.ndarray, usable: np.ndarray
) -> tuple[int, int]:
    """(slot, matched blocks) over usable slots; (-1, 0) when none is usable."""
    best = (-1, 0)
    best_count = 0
    for s in range(table.shape[0]):
        if not usable[s]:
            continue
        count = int(min(max(int(counts[s]), 0), table.shape[1]))
        limit = min(len(query), count)
        m = 0
        while m < limit and int(table[s, m]) == int(query[m]):
            m += 1
        if best[0] < 0 or m > best[1] or (m == best[1] and count < best_count):
            best, best_count = (s, m), count
    return best


_F32_EXP = np.uint32(0x7F800000)
_F32_SIGN = np.uint32(0x80000000)


def _flush(a: np.ndarray) -> np.ndarray:
    """float32 with denormals replaced by zeros of their sign."""
    u = a.view(np.uint32)
    return np.where((u & _F32_EXP) == 0, u & _F32_SIGN, u).view(np.float32)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 a: nearest even, denormals to zero, NaN quiet."""
    u = _flush(np.ascontiguousarray(a, dtype=np.float32)).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > _F32_EXP
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def _linear_y(acc: np.ndarray, bias: np.ndarray | None, add_to: np.ndarray | None, y_f32: bool) -> np.ndarray:
    """A linear's float32 sums [m, n] -> its y, as the kernels write it: + bias, then added
    to add_to's bfloat16 values, then float32 or bfloat16 (rounded to nearest even)."""
    with np.errstate(all="ignore"):
        if bias is not None:
            acc = acc + np.asarray(bias, dtype=np.float32)
        if add_to is not None:
            acc = bf16_to_f32(add_to) + acc
    return acc if y_f32 else f32_to_bf16(acc)


def bf16_linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None,
                y_f32: bool = False, add_to: np.ndarray | None = None) -> np.ndarray:
    """x uint16[m, k], w uint16[n, k] (bfloat16 bits, k even), bias float32[n] or None ->
    float32[m, n] when y_f32, else uint16[m, n] bfloat16 bits: of add_to + (x . w + bias)
    rounded once when add_to (uint16[m, n]) is given."""
    xf = _flush(bf16_to_f32(x))  # [m, k]
    wf = _flush(bf16_to_f32(w))  # [n, k]
    with np.errstate(all="ignore"):
        acc = _pair_chain(xf[:, None, :], wf[None, :, :])  # [m, n]
    return _linear_y(acc, bias, add_to, y_f32)


def _pair_chain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The rule's one accumulator per output: x, w float32 (flushed; broadcast against
    each other), last axis the elements -> the chain from +0 over their pairs in order,
    acc = flush(acc + x[2p + 1] w[2p + 1]), then flush(acc + x[2p] w[2p])."""
    acc = np.float32(0)
    for i in range(x.shape[-1] // 2):
        acc = _flush(np.asarray(acc + x[..., 2 * i + 1] * w[..., 2 * i + 1], dtype=np.float32))
        acc = _flush(np.asarray(acc + x[..., 2 * i] * w[..., 2 * i], dtype=np.float32))
    return acc


NORM_LANES = 8


def bf16_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x uint16[m, k], w uint16[k] bfloat16 bits -> uint16[m, k]: ss = sum of x**2 in
    float64, element i into lane i % 8 in order, lanes summed ((0+1)+(2+3))+((4+5)+(6+7));
    rstd = float32(1 / sqrt(ss / k + eps)); out = bfloat16((x * rstd) * w) in float32."""
    xf = bf16_to_f32(x)  # [m, k]
    m, k = xf.shape
    lanes = np.zeros((m, NORM_LANES), dtype=np.float64)
    xd = xf.astype(np.float64)
    for i in range(k):
        lanes[:, i % NORM_LANES] += xd[:, i] * xd[:, i]
    ss = ((lanes[:, 0] + lanes[:, 1]) + (lanes[:, 2] + lanes[:, 3])) + ((lanes[:, 4] + lanes[:, 5]) + (lanes[:, 6] + lanes[:, 7]))
    with np.errstate(all="ignore"):
        rstd = (1.0 / np.sqrt(ss / k + np.float64(np.float32(eps)))).astype(np.float32)  # [m]
        return f32_to_bf16((xf * rstd[:, None]) * bf16_to_f32(w)[None, :])


def bf16_rope_kv(qkv: np.ndarray, heads: int, kv_heads: int, cos: np.ndarray, sin: np.ndarray,
                 positions: np.ndarray, slots: np.ndarray, k_cache: np.ndarray,
                 v_cache: np.ndarray) -> None:
    """In place, as mb_bf16_rope_kv: qkv uint16[t, (heads + 2 kv_heads) * head_dim]; cos,
    sin uint16[capacity, head_dim]; caches uint16[n_slots, kv_heads, capacity, head_dim]."""
    t = qkv.shape[0]
    d = cos.shape[1]
    half = d // 2
    x = qkv.reshape(t, heads + 2 * kv_heads, d)
    qk = bf16_to_f32(x[:, : heads + kv_heads])  # [t, heads + kv_heads, head_dim]
    swapped = np.concatenate([qk[..., half:], qk[..., :half]], axis=-1)
    c = bf16_to_f32(cos[positions])[:, None, :]  # [t, 1, head_dim]
    s = bf16_to_f32(sin[positions])[:, None, :]
    with np.errstate(all="ignore"):
        rot = f32_to_bf16(qk * c + swapped * s)
    x[:, :heads] = rot[:, :heads]
    k_cache[slots, :, positions] = rot[:, heads:]
    v_cache[slots, :, positions] = x[:, heads + kv_heads:]


ATT_LANES = 16  # float32 lanes of one dot product (csrc/attention.c)
ATT_BLOCK = 64  # keys per online-softmax block


def att_exp(x: np.ndarray) -> np.ndarray:
    """e^x for float32 x <= 0, 0 below -80, by mb_att_exp's float32 operations."""
    f = np.float32
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(all="ignore"):
        y = np.maximum(x, f(-80.0))
        n = (y * f(1.44269504) + f(12582912.0)) - f(12582912.0)
        r = (y - n * f(0.693359375)) - n * f(-2.12194440e-4)
        p = np.full_like(r, f(1.9875691500e-4))
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = p * r + f(c)
        p = (p * (r * r) + r) + f(1.0)
        two_n = ((n.astype(np.int32) + 127).astype(np.uint32) << np.uint32(23)).view(np.float32)
        return np.where(x < f(-80.0), f(0.0), p * two_n).astype(np.float32)


def _att_dots(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """q float32[D] . keys float32[n, D] -> [n], in mb_att_dot's lane order."""
    prods = keys * q[None, :]  # [n, D]
    lane = prods[:, :ATT_LANES]
    for i in range(ATT_LANES, q.shape[0], ATT_LANES):
        lane = lane + prods[:, i:i + ATT_LANES]
    w = ATT_LANES // 2
    while w >= 1:
        lane = lane[:, :w] + lane[:, w:2 * w]
        w //= 2
    return lane[:, 0]


def bf16_attention(q: np.ndarray, rows: np.ndarray, slots: np.ndarray, ends: np.ndarray,
                   heads: int, kv_heads: int, window: int, scale: float, k_cache: np.ndarray,
                   v_cache: np.ndarray, out: np.ndarray) -> None:
    """As mb_bf16_attention (csrc/attention.c states the rule): q uint16[n_q, >= heads * D]
    (bfloat16 bits), caches uint16[n_slots, kv_heads, capacity, D]; writes out[rows[r],
    :heads * D] for every row r."""
    D = k_cache.shape[3]
    G = heads // kv_heads
    f = np.float32
    for r in range(len(rows)):
        end = int(ends[r])
        lo = end - window if 0 < window < end else 0
        for h in range(kv_heads):
            kf = bf16_to_f32(k_cache[slots[r], h, lo:end])  # [keys, D]
            vf = bf16_to_f32(v_cache[slots[r], h, lo:end])
            for g in range(G):
                head = h * G + g
                qf = bf16_to_f32(q[rows[r], head * D:(head + 1) * D])
                with np.errstate(all="ignore"):
                    s = _att_dots(qf, kf) * f(scale)  # [keys]
                    acc = np.zeros(D, dtype=np.float32)
                    m = l = f(0.0)
                    for b in range(0, end - lo, ATT_BLOCK):
                        block = s[b:b + ATT_BLOCK]
                        top = block.max()
                        if b == 0:
                            m, l = top, f(0.0)
                        elif top > m:
                            c = att_exp(np.array([m - top], dtype=np.float32))[0]
                            l, acc, m = l * c, acc * c, top
                        p = att_exp(block - m)
                        for i in range(p.shape[0]):
                            l = f(l + p[i])
                            acc = acc + p[i] * vf[b + i]
                    out[rows[r], head * D:(head + 1) * D] = f32_to_bf16(acc / l)


PF_BLOCK = 64  # keys per online-softmax block of the prefill kernel, anchored at key 0
PF_EXP2 = (0.6931241750717163, 0.24024099111557007, 0.05590642988681793, 0.009582851082086563)  # c1 .. c4
PF_LOG2E = 1.44269504


def pf_exp2(x: np.ndarray) -> np.ndarray:
    """As mb_pf_exp2: 2^x for float32 x <= 0 (NaN as -150), 0 below 2^-126, by the
    same float32 operations."""
    f = np.float32
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(all="ignore"):
        y = np.where(x > f(-150.0), x, f(-150.0))
        n = np.rint(y)
        r = y - n
        p = np.full_like(r, f(PF_EXP2[3]))
        for c in PF_EXP2[2::-1]:
            p = p * r + f(c)
        p = p * r + f(1.0)
        two_n = ((np.maximum(n, f(-126.0)).astype(np.int32) + 127).astype(np.uint32) << np.uint32(23)).view(np.float32)
        return np.where(n < f(-126.0), f(0.0), _flush((p * two_n).astype(np.float32)))


def bf16_prefill_attention(q: np.ndarray, firsts: np.ndarray, slots: np.ndarray, starts: np.ndarray,
                           lens: np.ndarray, heads: int, kv_heads: int, window: int, scale: float,
                           k_cache: np.ndarray, v_cache: np.ndarray, out: np.ndarray) -> None:
    """As mb_bf16_prefill_attention (csrc/attention.c states the rule): row r's queries
    q[firsts[r] + i] (uint16[n_q, >= heads * D] bfloat16 bits) at positions starts[r] + i
    attend causally over slot slots[r]'s keys (caches uint16[n_slots, kv_heads, capacity,
    D]), bfloat16 pair products summed as vdpbf16ps does, probabilities rounded to
    bfloat16; writes out[firsts[r] + i, :heads * D]."""
    D = k_cache.shape[3]
    G = heads // kv_heads
    f = np.float32
    scale2 = f(scale) * f(PF_LOG2E)  # the scores in base 2
    for r in range(len(firsts)):
        n, start, first = int(lens[r]), int(starts[r]), int(firsts[r])
        end = start + n
        pos = np.arange(start, end)[:, None]  # [n, 1]
        kpos = np.arange(end)[None, :]  # [1, end]
        valid = kpos <= pos  # [n, end]
        if window > 0:
            valid &= kpos > pos - window
        for h in range(kv_heads):
            kf = _flush(bf16_to_f32(k_cache[slots[r], h, :end]))  # [end, D]
            vf = _flush(bf16_to_f32(v_cache[slots[r], h, :end]))
            for g in range(G):
                head = h * G + g
                qf = _flush(bf16_to_f32(q[first:first + n, head * D:(head + 1) * D]))  # [n, D]
                with np.errstate(all="ignore"):
                    s = np.zeros((n, end), dtype=np.float32)
                    for x in range(0, D, 2):
                        s = _flush(s + np.multiply.outer(qf[:, x + 1], kf[:, x + 1]))
                        s = _flush(s + np.multiply.outer(qf[:, x], kf[:, x]))
                    s = np.where(valid, s * scale2, f(-np.inf))
                    m = np.full(n, -np.inf, dtype=np.float32)
                    l = np.zeros(n, dtype=np.float32)
                    acc = np.zeros((n, D), dtype=np.float32)
                    for b in range(0, end, PF_BLOCK):
                        block, ok = s[:, b:b + PF_BLOCK], valid[:, b:b + PF_BLOCK]
                        top = block.max(axis=1)
                        up = top > m
                        c = pf_exp2(np.where(up, m - top, f(0.0)))
                        l = np.where(up, l * c, l)
                        acc = np.where(up[:, None], acc * c[:, None], acc)
                        m = np.where(up, top, m)
                        p = np.where(ok, bf16_to_f32(f32_to_bf16(pf_exp2(block - m[:, None]))), f(0.0))
                        for k in range(0, p.shape[1], 2):
                            if k + 1 < p.shape[1]:
                                l = (l + p[:, k + 1]).astype(np.float32)
                                acc = _flush(acc + p[:, k + 1, None] * vf[b + k + 1][None, :])
                            l = (l + p[:, k]).astype(np.float32)
                            acc = _flush(acc + p[:, k, None] * vf[b + k][None, :])
                    out[first:first + n, head * D:(head + 1) * D] = f32_to_bf16(acc / l[:, None])


def bf16_silu_mul(x: np.ndarray) -> np.ndarray:
    """As mb_bf16_silu_mul: x uint16[m, 2n] ([gate | up] bfloat16 bits) -> uint16[m, n],
    bfloat16(silu(gate) * up) in float32 with e = att_exp(-|gate|)."""
    n = x.shape[1] // 2
    g, u = bf16_to_f32(x[:, :n]), bf16_to_f32(x[:, n:2 * n])
    with np.errstate(all="ignore"):
        e = att_exp(-np.abs(g))
        d = np.float32(1.0) + e
        s = np.where(g >= np.float32(0.0), g / d, (g * e) / d)
        return f32_to_bf16(s * u)


def bf16_decode_scratch(t: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                        intermediate: int) -> int:
    """bfloat16 elements of mb_bf16_decode_layers' scratch for t rows: h [t, hidden],
    qkv [t, (heads + 2 kv_heads) * head_dim], attn [t, heads * head_dim], gate|up
    [t, 2 intermediate], act [t, intermediate]; 0 for a size < 1."""
    if min(t, hidden, heads, kv_heads, head_dim, intermediate) < 1:
        return 0
    return t * (hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 3 * intermediate)


def bf16_decode_layers(layers, heads: int, kv_heads: int, eps: float, x: np.ndarray,
                       positions: np.ndarray, slots: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                       k_cache: np.ndarray, v_cache: np.ndarray, window: int, scale: float) -> None:
    """As mb_bf16_decode_layers (csrc/layers.c lists the calls), by this module's own
    functions: layers, one dict per layer of uint16 bfloat16 bits (input_norm, post_norm
    [hidden]; qkv [(heads + 2 kv_heads) * head_dim, hidden], o [hidden, heads * head_dim],
    gate_up [2 I, hidden], down [hidden, I]) and float32 qkv_bias / o_bias or None; x
    uint16[t, hidden] and the caches uint16[layers, n_slots, kv_heads, capacity, head_dim]
    changed in place; row i attends over keys [0, positions[i] + 1) of slots[i]."""
    t = x.shape[0]
    q_size = heads * cos.shape[1]
    rows = np.arange(t, dtype=np.int64)
    ends = np.asarray(positions, dtype=np.int64) + 1
    for li, layer in enumerate(layers):
        h = bf16_rmsnorm(x, layer["input_norm"], eps)
        qkv = bf16_linear(h, layer["qkv"], layer.get("qkv_bias"))
        bf16_rope_kv(qkv, heads, kv_heads, cos, sin, positions, slots, k_cache[li], v_cache[li])
        attn = np.zeros((t, q_size), dtype=np.uint16)
        bf16_attention(qkv, rows, slots, ends, heads, kv_heads, window, scale, k_cache[li], v_cache[li], attn)
        x[:] = bf16_linear(attn, layer["o"], layer.get("o_bias"), add_to=x)
        h = bf16_rmsnorm(x, layer["post_norm"], eps)
        x[:] = bf16_linear(bf16_silu_mul(bf16_linear(h, layer["gate_up"])), layer["down"], add_to=x)


# GGUF legacy blocks (csrc/quant.c): ggml type -> (bytes per block of 32, offset of d,
# offset of m or None). Q_* numbers are gguf.GGMLQuantizationType's.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q_BLOCK = 32
Q_FORMATS = {Q8_0: (34, None), Q4_0: (18, None), Q4_1: (20, 2), Q5_0: (22, None), Q5_1: (24, 2)}
Q_LANES = 4  # float32 lanes per output (q_linear)
Q_STEPS = 4  # vdpbf16ps steps per lane and block


def q_row_bytes(qtype: int, k: int) -> int:
    """Bytes of a row of k elements (0 when k is not a multiple of 32 or qtype not a legacy type)."""
    if qtype not in Q_FORMATS or k < Q_BLOCK or k % Q_BLOCK:
        return 0
    return k // Q_BLOCK * Q_FORMATS[qtype][0]


def q_parts(qtype: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """w uint8[n, row_bytes] -> (q float32[n, blocks, 32], d float32[n, blocks], m or None):
    the block's small integers (what d multiplies), its scale and its min. The integers
    are gguf's own dequantization (gguf.quants.dequantize) of the blocks with d set to
    1 and m to 0, so the layouts are gguf-py's, not ours; q * d + m is gguf's value."""
    from gguf import quants

    nbytes, m_at = Q_FORMATS[qtype]
    n = w.shape[0]
    blocks = np.ascontiguousarray(w, dtype=np.uint8).reshape(n, -1, nbytes)  # [n, blocks, bytes]
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = None if m_at is None else blocks[:, :, m_at:m_at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    unit = blocks.copy()
    unit[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if m_at is not None:
        unit[:, :, m_at:m_at + 2] = 0
    q = quants.dequantize(unit.reshape(n, -1), qtype).reshape(n, -1, Q_BLOCK)
    return q.astype(np.float32), d, m


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once (C's fmaf), for b of at most 29 significant bits (a
    float16, or one times a small integer): a * b is exact in float64; the float64 sum is rounded to odd (its exact error by
    TwoSum decides), after which rounding to float32 is the single rounding."""
    a64, c64 = a.astype(np.float64), np.broadcast_to(c, np.broadcast(a, b, c).shape).astype(np.float64)
    p = a64 * b.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # s + err == p + c exactly
    nudge = (err != 0) & ((s.view(np.uint64) & np.uint64(1)) == 0)
    s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def q_linear(qtype: int, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
             y_f32: bool = False, add_to: np.ndarray | None = None) -> np.ndarray:
    """x uint16[m, k] bfloat16 bits, w uint8[n, row_bytes] GGUF blocks of qtype -> y as
    bf16_linear's. Per output, 4 float32 lanes from 0, block after block (x flushed);
    lane l of a block takes the pairs p = 4s + l, s = 0..3, in order (vdpbf16ps's steps):
        t = 0;  t = flush(flush(t + x[2p+1] q[2p+1]) + x[2p] q[2p]);  acc[l] = fma(t, d, acc[l])
        with a min:  S = 0;  S = flush(flush(S + x[2p+1]) + x[2p]);  acc[l] = fma(S, m, acc[l])
    then (acc[0] + acc[2]) + (acc[1] + acc[3]), bias added."""
    q, d, mn = q_parts(qtype, w)  # [n, B, 32]; element 8s + 2l + e is pair 4s + l's e
    xf = _flush(bf16_to_f32(x)).reshape(x.shape[0], 1, -1, Q_STEPS, Q_LANES, 2)  # [m, 1, B, s, l, e]
    qp = q.reshape(1, q.shape[0], q.shape[1], Q_STEPS, Q_LANES, 2)  # [1, n, B, s, l, e]
    acc = np.zeros((x.shape[0], q.shape[0], Q_LANES), dtype=np.float32)  # [m, n, 4]
    with np.errstate(all="ignore"):
        t = np.zeros((x.shape[0], q.shape[0], q.shape[1], Q_LANES), dtype=np.float32)  # [m, n, B, 4]
        s = np.zeros((x.shape[0], 1, q.shape[1], Q_LANES), dtype=np.float32)  # [m, 1, B, 4]
        for step in range(Q_STEPS):
            xs, qs = xf[:, :, :, step], qp[:, :, :, step]  # [m, 1, B, 4, 2], [1, n, B, 4, 2]
            t = _flush(_flush(t + xs[..., 1] * qs[..., 1]) + xs[..., 0] * qs[..., 0])
            s = _flush(_flush(s + xs[..., 1]) + xs[..., 0])
        for b in range(q.shape[1]):
            acc = _fma32(t[:, :, b], d[None, :, b, None], acc)
            if mn is not None:
                acc = _fma32(s[:, :, b], mn[None, :, b, None], acc)
        out = (acc[..., 0] + acc[..., 2]) + (acc[..., 1] + acc[..., 3])  # [m, n]
    return _linear_y(out, bias, add_to, y_f32)


# ---- K-quant linear layers (kq_linear; csrc/kquant.c states the rule) ----
#
# y[r, c] = x[r] . dequant(w row c) on GGUF Q4_K / Q5_K / Q6_K blocks of 256 weights. Each
# weight goes in as the bfloat16 word W = 128 + u * 2^e, u its stored integer (Q4_K, Q5_K:
# q; Q6_K: q + 32), e = 3, 2, 1 (exact: u * 2^e < 128). A block's words go in four groups
# g of two 32-word vectors E, O; word w of E (O) holds the block weight KQ_SLOTS[type][g,
# 0 (1), w] (csrc/kquant.c's mb_kq_slot). Per output, 16 float32 lanes; lane l of group g
# takes E's words 2l, 2l+1 then O's: P = (+0 + x W at E 2l+1) + x W at E 2l, then P = (P +
# x W at O 2l+1) + x W at O 2l (products exact; the adds as two vdpbf16ps, denormals
# zero), A[l] = A[l] + s * P with s = float32(d) * sc * 2^-e of the lane's sub-block
# (exact). The offset comes back through sums of x: X16[j] = sum16 of x[16j .. 16j+15]
# (denormals zero), X32[t] = X16[2t] + X16[2t+1]; per block N[t] = N[t] + ((d*sc[t]) *
# 2^(7-e) + dmin*mn[t]) * X32[t] (Q4_K, Q5_K: 8 lanes) or N[j] = N[j] + ((d*sc[j]) * 96) *
# X16[j] (Q6_K: 16 lanes). Blocks in order; out = sum16(A) - sum8(N) (Q6_K: - sum16(N)),
# sum16 adding lane l and l + 8, then l and l + 4, l and l + 2, l and l + 1 (sum8 from l
# and l + 4); then + bias and y as bf16_linear writes it.
# q, s, mn and dmin*mn are read back from gguf's own dequantizer (`kq_parts`) on probe
# blocks, so the reference does not share the C code's reading of the layout.

KQ_BLOCK = 256
KQ_BLOCK_BYTES = {12: 144, 13: 176, 14: 210}  # Q4_K, Q5_K, Q6_K (ggml's type numbers)


def _kq_probe(blocks: np.ndarray, qtype: int, q: int | None = None, d: float | None = None,
              dmin: float | None = None, unit_scales: bool = False) -> np.ndarray:
    """gguf's dequantization (float32[..., 256]) of copies of blocks (uint8[..., bytes])
    with d / dmin set where given, every scale 1 and min 0 when unit_scales, every
    integer set to q (Q6_K: q - 32 stored) where given."""
    import gguf

    b = np.array(blocks, dtype=np.uint8, copy=True)

    def half(v: float) -> np.ndarray:
        return np.frombuffer(np.float16(v).tobytes(), dtype=np.uint8)

    if qtype == 14:  # ql[128] qh[64] scales int8[16] d
        if d is not None:
            b[..., 208:210] = half(d)
        if unit_scales:
            b[..., 192:208] = 1
        if q is not None:  # u = q + 32 in 6 bits: low 4 in ql's nibbles, 2 in qh's pairs
            u = q + 32
            b[..., 0:128] = (u & 15) | ((u & 15) << 4)
            b[..., 128:192] = (u >> 4) * 0x55
    else:  # d dmin scales[12] (qh[32] for Q5_K) qs[128]
        if d is not None:
            b[..., 0:2] = half(d)
        if dmin is not None:
            b[..., 2:4] = half(dmin)
        if unit_scales:  # sc = 1, mn = 0 for all eight sub-blocks
            b[..., 4:8], b[..., 8:12], b[..., 12:16] = 1, 0, 1
        if q is not None:
            b[..., -128:] = (q & 15) | ((q & 15) << 4)
            if qtype == 13:
                b[..., 16:48] = 255 if q >> 4 else 0
    flat = b.reshape(-1, b.shape[-1])
    out = gguf.quants.dequantize(flat, gguf.GGMLQuantizationType(qtype))
    return out.reshape(b.shape[:-1] + (KQ_BLOCK,)).astype(np.float32)


def kq_parts(blocks: np.ndarray, qtype: int):
    """blocks uint8[..., block bytes] -> (q, s, mn: float32[..., 256], dmin: float32[...]):
    each weight's integer (Q6_K: minus 32), d * sc and min integer (0 for Q6_K), and the
    block's dmin (0 for Q6_K), so that dequant = s * q - dmin * mn."""
    q = _kq_probe(blocks, qtype, d=1.0, dmin=0.0, unit_scales=True)
    s = _kq_probe(blocks, qtype, q=1, dmin=0.0)  # the block's own d and scales
    if qtype == 14:
        return q, s, np.zeros_like(q), np.zeros(q.shape[:-1], dtype=np.float32)
    mn = np.float32(0) - _kq_probe(blocks, qtype, q=0, d=0.0, dmin=1.0)  # +0, not -0
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    return q, s, mn, dmin


def _sum16(v: np.ndarray) -> np.ndarray:
    """[..., 16] float32 -> [...]: l + l+8, then l + l+4, l + l+2, l + l+1."""
    return _sum8(v[..., :8] + v[..., 8:])


def _sum8(v: np.ndarray) -> np.ndarray:
    """[..., 8] float32 -> [...]: l + l+4, then l + l+2, l + l+1."""
    v = v[..., :4] + v[..., 4:]
    v = v[..., :2] + v[..., 2:]
    return v[..., 0] + v[..., 1]


KQ_SHIFT = {12: 3, 13: 2, 14: 1}  # e of W = 128 + u * 2^e


def _kq_slots(q6: bool) -> np.ndarray:
    """int[4, 2, 32]: the block weight that word w of group g's E (0) / O (1) vector holds."""
    g, o, w = np.meshgrid(np.arange(4), np.arange(2), np.arange(32), indexing="ij")
    hi, i = w // 16, 2 * (w % 16) + o
    if q6:  # half g // 2, part 2 (g % 2) + hi
        return 128 * (g // 2) + 32 * (2 * (g % 2) + hi) + i
    return 32 * (4 * (g // 2) + 2 * hi + g % 2) + i  # chunk 4 (g // 2) + 2 hi + g % 2


KQ_SLOTS = {12: _kq_slots(False), 13: _kq_slots(False), 14: _kq_slots(True)}


def kq_linear(qtype: int, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
              y_f32: bool = False, add_to: np.ndarray | None = None) -> np.ndarray:
    """w uint8[n, k / 256 * block bytes] (GGUF rows), x uint16[m, k] bfloat16 bits, bias
    float32[n] or None -> float32[m, n] when y_f32, else bfloat16 bits (of add_to + out,
    rounded once, when add_to uint16[m, n] is given); the rule above."""
    n = w.shape[0]
    m, k = x.shape
    nb = k // KQ_BLOCK
    q6, e = qtype == 14, KQ_SHIFT[qtype]
    q, s, mn, dmin = kq_parts(np.asarray(w, dtype=np.uint8).reshape(n, nb, KQ_BLOCK_BYTES[qtype]), qtype)
    u = q + np.float32(32) if q6 else q
    slots = KQ_SLOTS[qtype]  # [4, 2, 32]
    word = (np.float32(128) + u * np.float32(2 ** e)).reshape(n, nb, KQ_BLOCK)[..., slots]
    word = word.reshape(n, nb, 4, 2, 16, 2)  # block, group, E/O, lane, (even, odd) word
    sw = s.reshape(n, nb, KQ_BLOCK)[..., slots[:, 0, 0::2]] * np.float32(2.0 ** -e)  # [n, nb, 4, 16]
    if q6:  # [n, nb, 16] per sub-block of 16
        coef = s[..., ::16] * np.float32(96)
    else:  # [n, nb, 8] per sub-block of 32: one rounding, the add
        coef = s[..., ::32] * np.float32(2 ** (7 - e)) + dmin[..., None] * mn[..., ::32]
    xf = _flush(bf16_to_f32(x))
    xw = xf.reshape(m, nb, KQ_BLOCK)[..., slots].reshape(m, 1, nb, 4, 2, 16, 2)
    zero = np.float32(0)
    with np.errstate(all="ignore"):
        x16 = _sum16(xf.reshape(m, nb * 16, 16))  # [m, k/16]
        xsum = x16.reshape(m, 1, nb, 16) if q6 else (x16[:, 0::2] + x16[:, 1::2]).reshape(m, 1, nb, 8)
        p = zero
        for o in range(2):  # [m, n, nb, 4, 16]: E's pair, then O's
            p = _flush(_flush(p + xw[..., o, :, 1] * word[..., o, :, 1]) + xw[..., o, :, 0] * word[..., o, :, 0])
        acc = np.zeros((m, n, 16), dtype=np.float32)
        mins = np.zeros((m, n, coef.shape[-1]), dtype=np.float32)
        for b in range(nb):
            for g in range(4):
                acc = acc + sw[:, b, g] * p[:, :, b, g]
            mins = mins + coef[:, b] * xsum[:, :, b]
        out = _sum16(acc) - (_sum16(mins) if q6 else _sum8(mins))  # [m, n]
    return _linear_y(out, bias, add_to, y_f32)


# ---- the tile rule (csrc/amx.c): prompt rows of the GGUF linears on AMX tiles ----
#
# Per output: acc = 0; per sub-block s of L elements (32; Q6_K 16), w = scale_s * q +
# min_s: P = tdp(x_s, q_s), acc = fma(P, scale_s, acc); with a min S = tdp(x_s, 1), acc =
# fma(S, min_s, acc); then + bias and y as bf16_linear writes it. tdp is one TDPBF16PS
# from a zero tile: E = +0, E = flush(E + x[2p] q[2p]) over the pairs p in order, O the
# same over the odd elements, P = flush(E + O) (x flushed). The parts are gguf's own
# dequantization's (q_parts, kq_parts).

TILE_SUB = {Q8_0: 32, Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, 12: 32, 13: 32, 14: 16}


def tile_parts(qtype: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """w uint8[n, row_bytes] -> (q float32[n, S, L], scale float32[n, S], min or None): the
    sub-blocks' small integers, scales and mins, so that gguf's value is q * scale + min."""
    n = w.shape[0]
    if qtype in Q_FORMATS:
        return q_parts(qtype, w)
    L = TILE_SUB[qtype]
    q, s, mn, dmin = kq_parts(np.asarray(w, dtype=np.uint8).reshape(n, -1, KQ_BLOCK_BYTES[qtype]), qtype)
    scale = s.reshape(n, -1, L)[..., 0]
    mins = None if qtype == 14 else -(dmin[..., None] * mn.reshape(n, -1, 8, L)[..., 0]).reshape(n, -1)
    return q.reshape(n, -1, L), scale, mins


def _tdp(x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """x float32[m, 1, S, L] (flushed), q float32[1 or n, ..., S, L] -> [m, n, S]: E over the
    even elements, O over the odd ones, each from +0 in pair order, then E + O."""
    e = o = np.float32(0)
    for p in range(x.shape[-1] // 2):
        e = _flush(np.asarray(e + x[..., 2 * p] * q[..., 2 * p], dtype=np.float32))
        o = _flush(np.asarray(o + x[..., 2 * p + 1] * q[..., 2 * p + 1], dtype=np.float32))
    return _flush(np.asarray(e + o, dtype=np.float32))


def _q_linear_subs(dot, qtype: int, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None,
                   y_f32: bool, add_to: np.ndarray | None) -> np.ndarray:
    """The prompt rules' shared frame: per sub-block P = dot(x_s, q_s), acc = fma(P,
    scale_s, acc), with a min S = dot(x_s, 1), acc = fma(S, min_s, acc)."""
    q, scale, mins = tile_parts(qtype, w)  # [n, S, L], [n, S]
    m, L = x.shape[0], q.shape[-1]
    xf = _flush(bf16_to_f32(x)).reshape(m, 1, -1, L)  # [m, 1, S, L]
    with np.errstate(all="ignore"):
        p = dot(xf, q[None])  # [m, n, S]
        sums = dot(xf, np.ones((1, 1, 1, L), dtype=np.float32)) if mins is not None else None  # [m, 1, S]
        acc = np.zeros((m, q.shape[0]), dtype=np.float32)
        for s in range(q.shape[1]):
            acc = _fma32(p[:, :, s], scale[None, :, s], acc)
            if mins is not None:
                acc = _fma32(sums[:, :, s], mins[None, :, s], acc)
    return _linear_y(acc, bias, add_to, y_f32)


def q_linear_tiles(qtype: int, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
                   y_f32: bool = False, add_to: np.ndarray | None = None) -> np.ndarray:
    """x uint16[m, k] bfloat16 bits, w uint8[n, row_bytes] GGUF blocks of qtype (any type
    q_linear or kq_linear takes) -> y as bf16_linear's, by the tile rule above."""
    return _q_linear_subs(_tdp, qtype, w, x, bias, y_f32, add_to)


# ---- the lanes rule (csrc/lanes.c): prompt rows of the GGUF linears on vdpbf16ps lanes ----
#
# The tile rule's frame with another dot: per sub-block bf16_linear's chain (_pair_chain:
# from +0, P = flush(flush(P + x[2p + 1] q[2p + 1]) + x[2p] q[2p]) over the pairs p in
# order, x flushed), the instruction's own order.


def q_linear_lanes(qtype: int, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
                   y_f32: bool = False, add_to: np.ndarray | None = None) -> np.ndarray:
    """As q_linear_tiles, by the lanes rule above."""
    return _q_linear_subs(_pair_chain, qtype, w, x, bias, y_f32, add_to)

"""The one importer of the C extension `mashbox._native` (built from csrc/ by cffi).

Same functions and classes as `mashbox.native_ref`, whose docstring states the rules.
When the extension is missing (not built), the reference is used instead and a warning
is logged; `NATIVE` says which one is loaded (the tests assert it is the C one) and
`MISSING` why. The worker refuses to serve on the reference (a fatal load error) unless
`MASHBOX_NATIVE=reference` (REFERENCE_ENV) asks for it: a server never falls back
silently to the slow path.

Over ~450 lines on purpose: one module wraps all of csrc (STYLE.md habit 8), each C
function with its checked array-level wrapper and, for the bfloat16 kernels, its
address-level one (called by mashbox/model/csrc.py only).

The wrappers check shapes and dtypes (ValueError naming the argument), hand numpy
buffers to C without copying where they already have the right layout, and keep one
scratch buffer per vocab size per thread, so nothing is allocated per call on the hot
path but the small output array.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Sequence

import numpy as np

from mashbox import native_ref

log = logging.getLogger(__name__)

REFERENCE_ENV = "MASHBOX_NATIVE"  # =reference: the worker may run without the extension
MISSING: Optional[str] = None  # why the extension could not be imported
try:
    from mashbox._native import ffi as _ffi, lib as _lib
except ImportError as exc:  # the extension was not built: slow but correct
    _ffi = _lib = None
    MISSING = f"mashbox._native is not built in {os.path.dirname(os.path.abspath(__file__))} ({exc})"
    log.warning("%s; using the pure Python reference (a server refuses to start on it unless "
                "%s=reference)", MISSING, REFERENCE_ENV)

NATIVE: bool = _lib is not None
NUM_PARAMS = native_ref.NUM_PARAMS
MASK64 = native_ref.MASK64

_ERRORS = {-1: "a length, shape or offset is out of range", -2: "scratch buffer too small"}


def _check(status: int, fn: str) -> None:
    if status != 0:
        raise ValueError(f"{fn}: {_ERRORS.get(status, f'status {status}')}")


def _array(a, dtype, name: str, ndim: int, writable: bool = False) -> np.ndarray:
    """a as a C-contiguous array of dtype; writable ones must already be exactly that."""
    if writable:
        if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable):
            raise ValueError(f"{name} must be a writable C-contiguous {np.dtype(dtype).name} array")
    else:
        a = np.ascontiguousarray(a, dtype=dtype)
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {a.shape}")
    return a


def _sample_args(logits, params, rng_state, hist_ids, hist_offsets, hist_gen_start):
    if not (isinstance(logits, np.ndarray) and logits.dtype == np.float32
            and logits.flags.c_contiguous and logits.flags.writeable):
        logits = np.array(logits, dtype=np.float32, order="C")  # a copy we may penalise
    logits = _array(logits, np.float32, "logits", 2, writable=True)
    rows, vocab = logits.shape
    params = _array(params, np.float32, "params", 2)
    if params.shape != (rows, NUM_PARAMS):
        raise ValueError(f"params must have shape ({rows}, {NUM_PARAMS}), got {params.shape}")
    rng_state = _array(rng_state, np.uint64, "rng_state", 1, writable=True)
    if rng_state.shape != (rows,):
        raise ValueError(f"rng_state must have shape ({rows},), got {rng_state.shape}")
    hist_ids = _array(hist_ids, np.int32, "hist_ids", 1)
    hist_offsets = _array(hist_offsets, np.int32, "hist_offsets", 1)
    if hist_offsets.shape != (rows + 1,):
        raise ValueError(f"hist_offsets must have shape ({rows + 1},), got {hist_offsets.shape}")
    hist_gen_start = _array(hist_gen_start, np.int32, "hist_gen_start", 1)
    if hist_gen_start.shape != (rows,):
        raise ValueError(f"hist_gen_start must have shape ({rows},), got {hist_gen_start.shape}")
    if vocab < 1 or vocab > native_ref.MAX_VOCAB:
        raise ValueError(f"logits: vocab must be in [1, {native_ref.MAX_VOCAB}], got {vocab}")
    return logits, params, rng_state, hist_ids, hist_offsets, hist_gen_start


class _Scratch(threading.local):
    """Per-thread scratch for mb_sample, one buffer per vocab size, made once."""

    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray] = {}

    def get(self, vocab: int) -> np.ndarray:
        buf = self.buffers.get(vocab)
        if buf is None:
            nbytes = int(_lib.mb_sample_scratch_bytes(vocab))
            buf = np.zeros((nbytes + 7) // 8, dtype=np.uint64)  # uint64: 8-byte aligned
            self.buffers[vocab] = buf
        return buf


_scratch = _Scratch()


def _ptr(ctype: str, a: np.ndarray):
    return _ffi.cast(ctype, _ffi.from_buffer(a, require_writable=False))


def rng_init(seed: int) -> int:
    """The 64-bit RNG state for a seed (any int, taken mod 2**64)."""
    if _lib is None:
        return native_ref.rng_init(seed)
    return int(_lib.mb_rng_init(int(seed) & MASK64))


def rng_next(rng_state: np.ndarray) -> np.ndarray:
    """One raw 64-bit draw per row; rng_state: uint64[rows], advanced in place."""
    rng_state = _array(rng_state, np.uint64, "rng_state", 1, writable=True)
    if _lib is None:
        return native_ref.rng_next(rng_state)
    out = np.empty(len(rng_state), dtype=np.uint64)
    _lib.mb_rng_next(_ptr("uint64_t *", rng_state), len(rng_state), _ptr("uint64_t *", out))
    return out


def sample(
    logits: np.ndarray,
    params: np.ndarray,
    rng_state: np.ndarray,
    hist_ids: np.ndarray,
    hist_offsets: np.ndarray,
    hist_gen_start: np.ndarray,
) -> np.ndarray:
    """One token per row: int32[rows]. logits float32[rows, vocab] (penalised in place
    when it is already C-contiguous float32, else a copy is), params float32[rows, 7]
    (temperature, top_p, top_k, min_p, repetition, frequency, presence penalties),
    rng_state uint64[rows] (advanced in place), hist_ids int32[n], hist_offsets
    int32[rows+1], hist_gen_start int32[rows] (see native_ref for the exact rules)."""
    args = _sample_args(logits, params, rng_state, hist_ids, hist_offsets, hist_gen_start)
    if _lib is None:
        offsets = args[4]
        if offsets[0] < 0 or offsets[-1] > len(args[3]) or np.any(np.diff(offsets) < 0):
            raise ValueError("hist_offsets must not decrease and must lie within [0, len(hist_ids)]")
        return native_ref.sample(*args)
    logits, params, rng_state, hist_ids, hist_offsets, hist_gen_start = args
    rows, vocab = logits.shape
    out = np.empty(rows, dtype=np.int32)
    if rows == 0:
        return out
    scratch = _scratch.get(vocab)
    status = _lib.mb_sample(
        _ptr("float *", logits), rows, vocab, _ptr("float *", params),
        _ptr("uint64_t *", rng_state), _ptr("int32_t *", hist_ids), len(hist_ids),
        _ptr("int32_t *", hist_offsets), _ptr("int32_t *", hist_gen_start),
        _ptr("int32_t *", out), _ffi.from_buffer(scratch), scratch.nbytes,
    )
    if status == -1:
        raise ValueError("hist_offsets must not decrease and must lie within [0, len(hist_ids)]")
    _check(status, "sample")
    return out


MAX_TOP_LOGPROBS = native_ref.MAX_TOP_LOGPROBS


def logprobs(logits: np.ndarray, ids: np.ndarray, top_n: int):
    """Per row: the chosen id's log probability and the top_n best ids with theirs, from
    float32[rows, vocab] logits as `sample` left them (see native_ref.logprobs). Returns
    (float32[rows], int32[rows, top_n], float32[rows, top_n])."""
    logits = _array(logits, np.float32, "logits", 2)
    rows, vocab = logits.shape
    ids = _array(ids, np.int32, "ids", 1)
    if ids.shape != (rows,):
        raise ValueError(f"ids must have shape ({rows},), got {ids.shape}")
    if vocab < 1 or vocab > native_ref.MAX_VOCAB:
        raise ValueError(f"logits: vocab must be in [1, {native_ref.MAX_VOCAB}], got {vocab}")
    if not 0 <= top_n <= min(MAX_TOP_LOGPROBS, vocab):
        raise ValueError(f"top_n must be in [0, {min(MAX_TOP_LOGPROBS, vocab)}], got {top_n}")
    if rows and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"ids must lie in [0, {vocab})")
    if _lib is None:
        return native_ref.logprobs(logits, ids, top_n)
    out = np.empty(rows, dtype=np.float32)
    top_ids = np.empty((rows, top_n), dtype=np.int32)
    top_lp = np.empty((rows, top_n), dtype=np.float32)
    if rows == 0:
        return out, top_ids, top_lp
    status = _lib.mb_logprobs(
        _ptr("float *", logits), rows, vocab, _ptr("int32_t *", ids), top_n, _ptr("float *", out),
        _ptr("int32_t *", top_ids), _ptr("float *", top_lp),
    )
    _check(status, "logprobs")
    return out, top_ids, top_lp


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray, row_mask: np.ndarray) -> None:
    """Constrained decoding's token mask on float32[rows, vocab] logits, in place (rules in
    native_ref.apply_token_bitmask): bitmask int32 or uint32[mask_rows, words]
    (llguidance's packed words), row_mask int32[rows] (-1: the row is left alone)."""
    logits = _array(logits, np.float32, "logits", 2, writable=True)
    rows, vocab = logits.shape
    if not (isinstance(bitmask, np.ndarray) and bitmask.dtype in (np.int32, np.uint32)
            and bitmask.ndim == 2 and bitmask.flags.c_contiguous):
        raise ValueError("bitmask must be a C-contiguous 2-dimensional int32 or uint32 array")
    mask_rows, words = bitmask.shape
    if words < 1:
        raise ValueError("bitmask must have at least one word per row")
    row_mask = _array(row_mask, np.int32, "row_mask", 1)
    if row_mask.shape != (rows,):
        raise ValueError(f"row_mask must have shape ({rows},), got {row_mask.shape}")
    if rows and (row_mask.min() < -1 or row_mask.max() >= mask_rows):
        raise ValueError(f"row_mask entries must lie in [-1, {mask_rows})")
    if vocab < 1:
        raise ValueError("logits: vocab must be at least 1")
    if _lib is None:
        native_ref.apply_token_bitmask(logits, bitmask.view(np.uint32), row_mask)
        return
    if rows == 0:
        return
    _check(_lib.mb_apply_token_bitmask(_ptr("float *", logits), rows, vocab, _ptr("uint32_t *", bitmask),
                                       mask_rows, words, _ptr("int32_t *", row_mask)), "apply_token_bitmask")


class StopMatcher:
    """Incremental stop-string matching with hold-back (rules in native_ref).

    feed(text) -> (text safe to emit, index of the matched stop or -1); after a match
    the emitted text ends right before the stop and later feeds return ("", index).
    flush() returns the held-back text when generation ends.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise ValueError("stops must be a sequence of strings, not a string")
        self.stops = tuple(stops)
        self.matched = -1
        if _lib is None:
            self._ref = native_ref.StopMatcher(self.stops)
            return
        self._ref = None
        encoded = [s.encode("utf-8", "surrogatepass") for s in self.stops]
        self._stop_bytes = b"".join(encoded)
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
        self._offsets[1:] = np.cumsum([len(e) for e in encoded])
        self._held = b""
        self._emit = _ffi.new("int32_t *")
        self._stop = _ffi.new("int32_t *")

    def feed(self, text: str) -> tuple[str, int]:
        if self._ref is not None:
            out = self._ref.feed(text)
            self.matched = self._ref.matched
            return out
        if self.matched >= 0:
            return "", self.matched
        if not text:
            return "", -1
        buf = self._held + text.encode("utf-8", "surrogatepass")
        status = _lib.mb_stop_scan(
            self._stop_bytes, _ptr("int32_t *", self._offsets), len(self.stops),
            buf, len(buf), len(self._held), self._emit, self._stop,
        )
        _check(status, "StopMatcher.feed")
        emit, stop = self._emit[0], self._stop[0]
        if stop >= 0:
            self.matched = stop
            self._held = b""
        else:
            self._held = buf[emit:]
        return buf[:emit].decode("utf-8", "surrogatepass"), stop

    def flush(self) -> str:
        if self._ref is not None:
            return self._ref.flush()
        held, self._held = self._held, b""
        return held.decode("utf-8", "surrogatepass")


def block_hashes(ids: np.ndarray, block: int) -> np.ndarray:
    """uint64[len(ids) // block]: chained hashes, hash i covers ids[: (i+1)*block]."""
    ids = _array(ids, np.int32, "ids", 1)
    if block < 1:
        raise ValueError("block must be >= 1")
    if _lib is None:
        return native_ref.block_hashes(ids, block)
    out = np.empty(len(ids) // block, dtype=np.uint64)
    _check(_lib.mb_block_hashes(_ptr("int32_t *", ids), len(ids), block, _ptr("uint64_t *", out)), "block_hashes")
    return out


def longest_prefix(
    query: np.ndarray, table: np.ndarray, counts: np.ndarray, usable: np.ndarray
) -> tuple[int, int]:
    """(slot, matched blocks): the usable slot sharing the most leading block hashes with
    query; ties go to fewer cached blocks, then the lower slot; (-1, 0) if none usable.
    query uint64[q], table uint64[slots, max_blocks], counts int32[slots] (valid hashes
    per row), usable uint8 or bool [slots]."""
    query = _array(query, np.uint64, "query", 1)
    table = _array(table, np.uint64, "table", 2)
    slots, max_blocks = table.shape
    counts = _array(counts, np.int32, "counts", 1)
    usable = _array(usable, np.uint8, "usable", 1)
    if counts.shape != (slots,) or usable.shape != (slots,):
        raise ValueError(f"counts and usable must have shape ({slots},)")
    if _lib is None:
        return native_ref.longest_prefix(query, table, counts, usable)
    slot = _ffi.new("int32_t *")
    blocks = _ffi.new("int32_t *")
    status = _lib.mb_longest_prefix(
        _ptr("uint64_t *", query), len(query), _ptr("uint64_t *", table), slots, max_blocks,
        _ptr("int32_t *", counts), _ptr("uint8_t *", usable), slot, blocks,
    )
    _check(status, "longest_prefix")
    return int(slot[0]), int(blocks[0])


# bfloat16 kernels (csrc/linear.c, attention.c, layers.c). The *_ptr functions take
# addresses and lengths and serve one caller, mashbox/model/csrc.py, which checks the
# torch tensors (dtype, shape, strides, sizes) before it takes their addresses; the
# array-level functions (bf16_linear, bf16_attention, ...) are the checked twins of
# native_ref's, for the parity tests.
KERNEL_PORTABLE, KERNEL_AVX512BF16 = 1, 2
# q_linear's legacy types only: KERNEL_AVX512BF16 as CPUs without AVX512-VBMI run Q8_0 (the same bits)
KERNEL_AVX512BF16_INT32 = 3
# AVX2 + FMA: the linears (bf16_linear, q_linear) emulate vdpbf16ps with fused adds (the same
# bits where the rule's limits hold); the other kernel-taking calls run their portable path
KERNEL_AVX2 = 4
Y_BF16, Y_F32, Y_ADD_BF16 = 0, 1, 2  # what bf16_linear_ptr writes to y (csrc/mashbox.h)


def bf16_kernel() -> int:
    """The fastest bf16 linear kernel this CPU runs (KERNEL_*); 0 without the extension."""
    return int(_lib.mb_bf16_kernel()) if _lib is not None else 0


def blocks_kernel_runs() -> bool:
    """The fastest kernel here is one the GGUF blocks are served on (KERNEL_AVX512BF16 or
    KERNEL_AVX2; the portable one is for the tests)."""
    return bf16_kernel() in (KERNEL_AVX512BF16, KERNEL_AVX2)


def avx2_supported() -> bool:
    """KERNEL_AVX2 runs on this CPU (AVX2, FMA, F16C; AVX-512 CPUs too)."""
    return _lib is not None and bool(_lib.mb_avx2_supported())


def bf16_packed_bytes(n: int, k: int) -> int:
    """Bytes of a [n, k] weight's packed form; 0 when the kernel cannot take it (odd k)."""
    return int(_lib.mb_bf16_packed_bytes(n, k))


def bf16_pack_ptr(w: int, n: int, k: int, packed: int) -> None:
    """Pack the [n, k] bfloat16 weight at address w into bf16_packed_bytes(n, k) bytes at packed."""
    _check(_lib.mb_bf16_pack(_ffi.cast("uint16_t *", w), n, k, _ffi.cast("uint16_t *", packed)), "bf16_pack")


def bf16_linear_ptr(x: int, ldx: int, m: int, packed: int, n: int, k: int, bias: int, y: int,
                    y_mode: int, ldy: int, kernel: int, parallel: int, threads: int) -> None:
    """mb_bf16_linear on addresses (0 for no bias / no parallel pool); see csrc/mashbox.h."""
    _check(_lib.mb_bf16_linear(
        _ffi.cast("uint16_t *", x), ldx, m, _ffi.cast("uint16_t *", packed), n, k,
        _ffi.cast("float *", bias), _ffi.cast("void *", y), y_mode, ldy, kernel,
        _ffi.cast("void *", parallel), threads), "bf16_linear")


def kq_linear_ptr(qtype: int, w: int, row_bytes: int, n: int, k: int, x: int, ldx: int, m: int,
                  bias: int, y: int, y_mode: int, ldy: int, kernel: int, parallel: int,
                  threads: int) -> None:
    """mb_kq_linear on addresses (Q4_K / Q5_K / Q6_K blocks; 0 for no bias / pool)."""
    _check(_lib.mb_kq_linear(
        qtype, _ffi.cast("uint8_t *", w), row_bytes, n, k, _ffi.cast("uint16_t *", x), ldx, m,
        _ffi.cast("float *", bias), _ffi.cast("void *", y), y_mode, ldy, kernel,
        _ffi.cast("void *", parallel), threads), "kq_linear")


def bf16_gather_rows_ptr(packed: int, n: int, k: int, ids: int, count: int, out: int) -> None:
    """mb_bf16_gather_rows on addresses; see csrc/mashbox.h."""
    _check(_lib.mb_bf16_gather_rows(_ffi.cast("uint16_t *", packed), n, k, _ffi.cast("int64_t *", ids),
                                    count, _ffi.cast("uint16_t *", out)), "bf16_gather_rows")


def _bf16_packed(w: np.ndarray) -> np.ndarray:
    """w uint16[n, k] (C-contiguous, k even) in mb_bf16_pack's layout."""
    n, k = w.shape
    packed = np.empty(bf16_packed_bytes(n, k) // 2, dtype=np.uint16)
    bf16_pack_ptr(w.ctypes.data, n, k, packed.ctypes.data)
    return packed


def bf16_gather_rows(w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """w[ids] (uint16[n, k] bfloat16 bits, k even), read from w's packed form by C: the
    array-level check of mb_bf16_gather_rows against plain indexing."""
    w = _array(w, np.uint16, "w", 2)
    ids = _array(ids, np.int64, "ids", 1)
    n, k = w.shape
    if k % 2 or k < 2:
        raise ValueError(f"w needs an even k >= 2, got {w.shape}")
    if _lib is None:
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise ValueError("bf16_gather_rows: a length, shape or offset is out of range")
        return w[ids]
    packed = _bf16_packed(w)
    out = np.empty((len(ids), k), dtype=np.uint16)
    bf16_gather_rows_ptr(packed.ctypes.data, n, k, ids.ctypes.data, len(ids), out.ctypes.data)
    return out


def bf16_rmsnorm_ptr(x: int, ldx: int, m: int, k: int, w: int, eps: float, out: int, ldo: int,
                     parallel: int = 0, threads: int = 1) -> None:
    """mb_bf16_rmsnorm on addresses; see csrc/mashbox.h."""
    _check(_lib.mb_bf16_rmsnorm(_ffi.cast("uint16_t *", x), ldx, m, k, _ffi.cast("uint16_t *", w),
                                eps, _ffi.cast("uint16_t *", out), ldo, _ffi.cast("void *", parallel), threads),
           "bf16_rmsnorm")


def bf16_rope_kv_ptr(qkv: int, ldq: int, t: int, heads: int, kv_heads: int, head_dim: int,
                     cos: int, sin: int, positions: int, slots: int, k_cache: int, v_cache: int,
                     n_slots: int, capacity: int, table_rows: int, parallel: int = 0, threads: int = 1) -> None:
    """mb_bf16_rope_kv on addresses; see csrc/mashbox.h."""
    u16 = "uint16_t *"
    _check(_lib.mb_bf16_rope_kv(
        _ffi.cast(u16, qkv), ldq, t, heads, kv_heads, head_dim, _ffi.cast(u16, cos), _ffi.cast(u16, sin),
        _ffi.cast("int64_t *", positions), _ffi.cast("int64_t *", slots), _ffi.cast(u16, k_cache),
        _ffi.cast(u16, v_cache), n_slots, capacity, table_rows, _ffi.cast("void *", parallel), threads),
        "bf16_rope_kv")


def bf16_rope_kv(qkv: np.ndarray, heads: int, kv_heads: int, cos: np.ndarray, sin: np.ndarray,
                 positions: np.ndarray, slots: np.ndarray, k_cache: np.ndarray,
                 v_cache: np.ndarray) -> None:
    """native_ref.bf16_rope_kv through C (qkv and the caches C-contiguous uint16, changed
    in place)."""
    for name, a in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache)):
        _array(a, np.uint16, name, a.ndim, writable=True)
    cos = _array(cos, np.uint16, "cos", 2)
    sin = _array(sin, np.uint16, "sin", 2)
    positions = _array(positions, np.int64, "positions", 1)
    slots = _array(slots, np.int64, "slots", 1)
    if _lib is None:
        native_ref.bf16_rope_kv(qkv, heads, kv_heads, cos, sin, positions, slots, k_cache, v_cache)
        return
    bf16_rope_kv_ptr(qkv.ctypes.data, qkv.shape[1], qkv.shape[0], heads, kv_heads, cos.shape[1],
                     cos.ctypes.data, sin.ctypes.data, positions.ctypes.data, slots.ctypes.data,
                     k_cache.ctypes.data, v_cache.ctypes.data, k_cache.shape[0], k_cache.shape[2],
                     cos.shape[0])


def bf16_attention_ptr(q: int, ldq: int, n_q: int, rows: int, slots: int, ends: int, t: int,
                       heads: int, kv_heads: int, head_dim: int, window: int, scale: float,
                       k_cache: int, v_cache: int, n_slots: int, capacity: int, out: int, ldo: int,
                       kernel: int, parallel: int, threads: int) -> None:
    """mb_bf16_attention on addresses (parallel 0: the calling thread); see csrc/mashbox.h."""
    u16, i64 = "uint16_t *", "int64_t *"
    _check(_lib.mb_bf16_attention(
        _ffi.cast(u16, q), ldq, n_q, _ffi.cast(i64, rows), _ffi.cast(i64, slots), _ffi.cast(i64, ends), t,
        heads, kv_heads, head_dim, window, scale, _ffi.cast(u16, k_cache), _ffi.cast(u16, v_cache),
        n_slots, capacity, _ffi.cast(u16, out), ldo, kernel, _ffi.cast("void *", parallel), threads),
        "bf16_attention")


def bf16_attention(q: np.ndarray, rows: np.ndarray, slots: np.ndarray, ends: np.ndarray,
                   heads: int, kv_heads: int, window: int, scale: float, k_cache: np.ndarray,
                   v_cache: np.ndarray, out: np.ndarray, kernel: int | None = None) -> None:
    """native_ref.bf16_attention through C (q, out uint16[n, width]; caches uint16[n_slots,
    kv_heads, capacity, head_dim], all C-contiguous; out written in place), on the calling
    thread, with `kernel` (default the fastest here)."""
    q = _array(q, np.uint16, "q", 2)
    _array(out, np.uint16, "out", 2, writable=True)
    k_cache = _array(k_cache, np.uint16, "k_cache", 4)
    v_cache = _array(v_cache, np.uint16, "v_cache", 4)
    rows, slots, ends = (_array(a, np.int64, name, 1) for a, name in ((rows, "rows"), (slots, "slots"), (ends, "ends")))
    if not len(rows) == len(slots) == len(ends):
        raise ValueError("rows, slots and ends must have one entry per row")
    if _lib is None:
        native_ref.bf16_attention(q, rows, slots, ends, heads, kv_heads, window, scale, k_cache, v_cache, out)
        return
    n_slots, _, capacity, head_dim = k_cache.shape
    bf16_attention_ptr(q.ctypes.data, q.shape[1], q.shape[0], rows.ctypes.data, slots.ctypes.data,
                       ends.ctypes.data, len(rows), heads, kv_heads, head_dim, window, scale,
                       k_cache.ctypes.data, v_cache.ctypes.data, n_slots, capacity, out.ctypes.data,
                       out.shape[1], bf16_kernel() if kernel is None else kernel, 0, 1)


def bf16_prefill_attention_ptr(q: int, ldq: int, n_q: int, firsts: int, slots: int, starts: int, lens: int,
                               t: int, heads: int, kv_heads: int, head_dim: int, window: int, scale: float,
                               k_cache: int, v_cache: int, n_slots: int, capacity: int, out: int, ldo: int,
                               kernel: int, parallel: int, threads: int) -> None:
    """mb_bf16_prefill_attention on addresses (parallel 0: the calling thread); see csrc/mashbox.h."""
    u16, i64 = "uint16_t *", "int64_t *"
    _check(_lib.mb_bf16_prefill_attention(
        _ffi.cast(u16, q), ldq, n_q, _ffi.cast(i64, firsts), _ffi.cast(i64, slots), _ffi.cast(i64, starts),
        _ffi.cast(i64, lens), t, heads, kv_heads, head_dim, window, scale, _ffi.cast(u16, k_cache),
        _ffi.cast(u16, v_cache), n_slots, capacity, _ffi.cast(u16, out), ldo, kernel,
        _ffi.cast("void *", parallel), threads), "bf16_prefill_attention")


def bf16_prefill_attention(q: np.ndarray, firsts: np.ndarray, slots: np.ndarray, starts: np.ndarray,
                           lens: np.ndarray, heads: int, kv_heads: int, window: int, scale: float,
                           k_cache: np.ndarray, v_cache: np.ndarray, out: np.ndarray,
                           kernel: int | None = None) -> None:
    """native_ref.bf16_prefill_attention through C (q, out uint16[n, width]; caches
    uint16[n_slots, kv_heads, capacity, head_dim], all C-contiguous; out written in place),
    on the calling thread, with `kernel` (default the fastest here)."""
    q = _array(q, np.uint16, "q", 2)
    _array(out, np.uint16, "out", 2, writable=True)
    k_cache = _array(k_cache, np.uint16, "k_cache", 4)
    v_cache = _array(v_cache, np.uint16, "v_cache", 4)
    firsts, slots, starts, lens = (_array(a, np.int64, name, 1) for a, name in (
        (firsts, "firsts"), (slots, "slots"), (starts, "starts"), (lens, "lens")))
    if not len(firsts) == len(slots) == len(starts) == len(lens):
        raise ValueError("firsts, slots, starts and lens must have one entry per row")
    if _lib is None:
        native_ref.bf16_prefill_attention(q, firsts, slots, starts, lens, heads, kv_heads, window, scale,
                                          k_cache, v_cache, out)
        return
    n_slots, _, capacity, head_dim = k_cache.shape
    bf16_prefill_attention_ptr(q.ctypes.data, q.shape[1], q.shape[0], firsts.ctypes.data, slots.ctypes.data,
                               starts.ctypes.data, lens.ctypes.data, len(firsts), heads, kv_heads, head_dim,
                               window, scale, k_cache.ctypes.data, v_cache.ctypes.data, n_slots, capacity,
                               out.ctypes.data, out.shape[1], bf16_kernel() if kernel is None else kernel, 0, 1)


def bf16_silu_mul_ptr(x: int, ldx: int, m: int, n: int, out: int, ldo: int, parallel: int = 0,
                      threads: int = 1) -> None:
    """mb_bf16_silu_mul on addresses; see csrc/mashbox.h."""
    _check(_lib.mb_bf16_silu_mul(_ffi.cast("uint16_t *", x), ldx, m, n, _ffi.cast("uint16_t *", out), ldo,
                                 _ffi.cast("void *", parallel), threads), "bf16_silu_mul")


def bf16_silu_mul(x: np.ndarray) -> np.ndarray:
    """native_ref.bf16_silu_mul through C: x uint16[m, 2n] ([gate | up]) -> uint16[m, n]."""
    x = _array(x, np.uint16, "x", 2)
    if x.shape[1] < 2 or x.shape[1] % 2:
        raise ValueError(f"x must hold [gate | up] halves of equal width, got shape {x.shape}")
    if _lib is None:
        return native_ref.bf16_silu_mul(x)
    n = x.shape[1] // 2
    out = np.empty((x.shape[0], n), dtype=np.uint16)
    bf16_silu_mul_ptr(x.ctypes.data, x.shape[1], x.shape[0], n, out.ctypes.data, n)
    return out


LAYER_WEIGHTS = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")  # struct mb_layer's uint16_t * fields (and v, 0 when absent)
LAYER_BIASES = ("qkv_bias", "o_bias")  # its float * fields (0: none)
LAYER_BLOCKS = ("qkv", "o", "gate_up", "down", "v")  # linears with <name>_type, <name>_row_bytes (0: packed)


def bf16_layers(layers: Sequence[dict[str, int]]):
    """A C array of struct mb_layer (csrc/mashbox.h) from one dict of addresses per layer
    (keys: its fields; 0 for a missing bias). The caller keeps the buffers those
    addresses point into alive as long as the array: mashbox/model/csrc.py's LayerTable
    owns both."""
    arr = _ffi.new("struct mb_layer[]", len(layers))
    for i, layer in enumerate(layers):
        for name in LAYER_WEIGHTS:
            setattr(arr[i], name, _ffi.cast("uint16_t *", layer[name]))
        arr[i].v = _ffi.cast("uint16_t *", layer.get("v", 0))  # NULL: v is part of qkv
        for name in LAYER_BIASES:
            setattr(arr[i], name, _ffi.cast("float *", layer.get(name, 0)))
        for name in LAYER_BLOCKS:  # 0 when absent: packed bfloat16
            setattr(arr[i], name + "_type", int(layer.get(name + "_type", 0)))
            setattr(arr[i], name + "_row_bytes", int(layer.get(name + "_row_bytes", 0)))
    return arr


def bf16_decode_scratch(t: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                        intermediate: int) -> int:
    """bfloat16 elements of scratch mb_bf16_decode_layers needs for t rows (C states the
    size; native_ref.bf16_decode_scratch is its twin)."""
    if _lib is None:
        return native_ref.bf16_decode_scratch(t, hidden, heads, kv_heads, head_dim, intermediate)
    return int(_lib.mb_bf16_decode_scratch(t, hidden, heads, kv_heads, head_dim, intermediate))


def bf16_decode_layers_ptr(layers, n_layers: int, hidden: int, heads: int, kv_heads: int,
                           head_dim: int, intermediate: int, eps: float, x: int, t: int,
                           positions: int, rows: int, slots: int, ends: int, cos: int, sin: int,
                           table_rows: int, k_cache: int, v_cache: int, layer_stride: int,
                           n_slots: int, capacity: int, window: int, scale: float, scratch: int,
                           scratch_len: int, kernel: int, parallel: int, threads: int) -> None:
    """mb_bf16_decode_layers; layers from bf16_layers, the rest addresses, scratch_len
    its bfloat16 elements (C checks it against mb_bf16_decode_scratch); see csrc/mashbox.h."""
    u16, i64 = "uint16_t *", "int64_t *"
    _check(_lib.mb_bf16_decode_layers(
        layers, n_layers, hidden, heads, kv_heads, head_dim, intermediate, eps, _ffi.cast(u16, x), t,
        _ffi.cast(i64, positions), _ffi.cast(i64, rows), _ffi.cast(i64, slots), _ffi.cast(i64, ends),
        _ffi.cast(u16, cos), _ffi.cast(u16, sin), table_rows, _ffi.cast(u16, k_cache),
        _ffi.cast(u16, v_cache), layer_stride, n_slots, capacity, window, scale, _ffi.cast(u16, scratch),
        scratch_len, kernel, _ffi.cast("void *", parallel), threads), "bf16_decode_layers")


def bf16_decode_layers(layers: Sequence[dict], heads: int, kv_heads: int, eps: float, x: np.ndarray,
                       positions: np.ndarray, slots: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                       k_cache: np.ndarray, v_cache: np.ndarray, window: int, scale: float,
                       kernel: int | None = None) -> None:
    """native_ref.bf16_decode_layers through C, on the calling thread: the same layers
    (plain uint16 weights, packed here), x uint16[t, hidden] and the caches uint16[layers,
    n_slots, kv_heads, capacity, head_dim] (C-contiguous) changed in place."""
    for name, a in (("x", x), ("k_cache", k_cache), ("v_cache", v_cache)):
        _array(a, np.uint16, name, 2 if name == "x" else 5, writable=True)
    cos, sin = _array(cos, np.uint16, "cos", 2), _array(sin, np.uint16, "sin", 2)
    positions, slots = _array(positions, np.int64, "positions", 1), _array(slots, np.int64, "slots", 1)
    t, hidden = x.shape
    if positions.shape != (t,) or slots.shape != (t,):
        raise ValueError(f"positions and slots must have shape ({t},)")
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != len(layers):
        raise ValueError(f"k_cache and v_cache must have shape (layers, ...) alike, got {k_cache.shape}, {v_cache.shape}")
    if _lib is None:
        native_ref.bf16_decode_layers(layers, heads, kv_heads, eps, x, positions, slots, cos, sin,
                                      k_cache, v_cache, window, scale)
        return
    head_dim = cos.shape[1]
    intermediate = layers[0]["down"].shape[1] if layers else 1
    keep, entries = [], []  # keep: the packed weights and biases the C array points into
    for layer in layers:
        entry = {}
        for name in LAYER_WEIGHTS:
            a = _array(layer[name], np.uint16, name, 1 if name.endswith("norm") else 2)
            a = _bf16_packed(a) if a.ndim == 2 else a
            keep.append(a)
            entry[name] = a.ctypes.data
        for name in LAYER_BIASES:
            if layer.get(name) is not None:
                b = _array(layer[name], np.float32, name, 1)
                keep.append(b)
                entry[name] = b.ctypes.data
        entries.append(entry)
    arr = bf16_layers(entries)
    ends = positions + 1
    rows = np.arange(t, dtype=np.int64)
    scratch = np.empty(bf16_decode_scratch(t, hidden, heads, kv_heads, head_dim, intermediate), np.uint16)
    _, n_slots, _, capacity, _ = k_cache.shape
    bf16_decode_layers_ptr(arr, len(layers), hidden, heads, kv_heads, head_dim, intermediate, eps,
                           x.ctypes.data, t, positions.ctypes.data, rows.ctypes.data, slots.ctypes.data,
                           ends.ctypes.data, cos.ctypes.data, sin.ctypes.data, cos.shape[0],
                           k_cache.ctypes.data, v_cache.ctypes.data, k_cache[0].size, n_slots, capacity,
                           window, scale, scratch.ctypes.data, scratch.size,
                           bf16_kernel() if kernel is None else kernel, 0, 1)


def bf16_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """native_ref.bf16_rmsnorm through C."""
    x = _array(x, np.uint16, "x", 2)
    w = _array(w, np.uint16, "w", 1)
    if w.shape != (x.shape[1],) or x.shape[1] < 1:
        raise ValueError(f"w must have shape ({x.shape[1]},) and k >= 1, got {w.shape}")
    if _lib is None:
        return native_ref.bf16_rmsnorm(x, w, eps)
    out = np.empty_like(x)
    bf16_rmsnorm_ptr(x.ctypes.data, x.shape[1], x.shape[0], x.shape[1], w.ctypes.data, eps,
                     out.ctypes.data, x.shape[1])
    return out


def kq_linear(qtype: int, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
              y_f32: bool = False, add_to: np.ndarray | None = None, kernel: int | None = None,
              parallel: int = 0, threads: int = 1) -> np.ndarray:
    """native_ref.kq_linear through the C kernel: w uint8[n, row bytes] GGUF rows, x
    uint16[m, k] (rows may be strided), on `kernel` (default the fastest here)."""
    w = _array(w, np.uint8, "w", 2)
    x = np.asarray(x)
    if x.dtype != np.uint16 or x.ndim != 2 or x.strides[1] != 2:
        x = _array(x, np.uint16, "x", 2)
    m, k = x.shape
    n, blocks = w.shape[0], k // native_ref.KQ_BLOCK
    if qtype not in native_ref.KQ_BLOCK_BYTES or k % native_ref.KQ_BLOCK or m < 1 or n < 1 or blocks < 1 \
            or w.shape[1] < blocks * native_ref.KQ_BLOCK_BYTES[qtype]:
        raise ValueError(f"kq_linear: type {qtype}, x {x.shape}, w {w.shape} do not fit")
    if bias is not None:
        bias = _array(bias, np.float32, "bias", 1)
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},), got {bias.shape}")
    if add_to is not None:
        add_to = _array(add_to, np.uint16, "add_to", 2)
        if y_f32 or add_to.shape != (m, n):
            raise ValueError(f"add_to must be bfloat16 output of shape ({m}, {n})")
    if _lib is None:
        return native_ref.kq_linear(qtype, w[:, :blocks * native_ref.KQ_BLOCK_BYTES[qtype]],
                                    np.ascontiguousarray(x), bias, y_f32, add_to)
    y, mode = _linear_y(add_to, y_f32, m, n)
    kq_linear_ptr(qtype, w.ctypes.data, w.shape[1], n, k, x.ctypes.data, x.strides[0] // 2, m,
                  0 if bias is None else bias.ctypes.data, y.ctypes.data, mode, n,
                  bf16_kernel() if kernel is None else kernel, parallel, threads)
    return y


def _linear_y(add_to: np.ndarray | None, y_f32: bool, m: int, n: int) -> tuple[np.ndarray, int]:
    """A linear's output [m, n] and its y mode: a copy of add_to (Y_ADD_BF16), else float32
    (Y_F32) or bfloat16 (Y_BF16)."""
    if add_to is not None:
        return add_to.copy(), Y_ADD_BF16
    return np.empty((m, n), dtype=np.float32 if y_f32 else np.uint16), (Y_F32 if y_f32 else Y_BF16)


def _linear_extras(bias: np.ndarray | None, add_to: np.ndarray | None, y_f32: bool, m: int,
                   n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A linear's bias float32 [n] and add_to bfloat16 [m, n], checked (either may be None)."""
    if bias is not None:
        bias = _array(bias, np.float32, "bias", 1)
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},), got {bias.shape}")
    if add_to is not None:
        if y_f32:
            raise ValueError("add_to takes bfloat16 output (y_f32=False)")
        add_to = _array(add_to, np.uint16, "add_to", 2)
        if add_to.shape != (m, n):
            raise ValueError(f"add_to must have shape ({m}, {n}), got {add_to.shape}")
    return bias, add_to


def bf16_linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None,
                y_f32: bool = False, add_to: np.ndarray | None = None,
                kernel: int | None = None) -> np.ndarray:
    """native_ref.bf16_linear through the C kernel (`kernel`, default the fastest here)."""
    x = _array(x, np.uint16, "x", 2)
    w = _array(w, np.uint16, "w", 2)
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or k % 2 or m < 1 or n < 1:
        raise ValueError(f"x [m, k] and w [n, k] need the same even k >= 2, got {x.shape} and {w.shape}")
    bias, add_to = _linear_extras(bias, add_to, y_f32, m, n)
    if _lib is None:
        return native_ref.bf16_linear(x, w, bias, y_f32, add_to)
    packed = _bf16_packed(w)
    y, mode = _linear_y(add_to, y_f32, m, n)
    bf16_linear_ptr(x.ctypes.data, k, m, packed.ctypes.data, n, k, 0 if bias is None else bias.ctypes.data,
                    y.ctypes.data, mode, n, bf16_kernel() if kernel is None else kernel, 0, 1)
    return y


# GGUF block linears (csrc/quant.c): type numbers are ggml's (native_ref.Q_*).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = native_ref.Q4_0, native_ref.Q4_1, native_ref.Q5_0, native_ref.Q5_1, native_ref.Q8_0
Q4_K, Q5_K, Q6_K = 12, 13, 14  # forwarded by mb_q_linear to csrc/kquant.c's mb_kq_linear
Q_LEGACY = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)


def q_row_bytes(qtype: int, k: int) -> int:
    """Bytes of a k-element row of a legacy block type (0: not one, or k not a multiple of 32)."""
    return int(_lib.mb_q_row_bytes(qtype, k)) if _lib is not None else native_ref.q_row_bytes(qtype, k)


def q_linear_ptr(qtype: int, w: int, row_bytes: int, n: int, k: int, x: int, ldx: int, m: int, bias: int,
                 y: int, y_mode: int, ldy: int, kernel: int, parallel: int, threads: int) -> None:
    """mb_q_linear on addresses (0 for no bias / no parallel pool); see csrc/mashbox.h."""
    _check(_lib.mb_q_linear(
        qtype, _ffi.cast("uint8_t *", w), row_bytes, n, k, _ffi.cast("uint16_t *", x), ldx, m,
        _ffi.cast("float *", bias), _ffi.cast("void *", y), y_mode, ldy, kernel,
        _ffi.cast("void *", parallel), threads), "q_linear")


def q_linear(qtype: int, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
             y_f32: bool = False, add_to: np.ndarray | None = None, kernel: int | None = None) -> np.ndarray:
    """native_ref.q_linear through the C kernel (`kernel`, default the fastest here); w
    uint8[n, row_bytes] blocks, x uint16[m, k]."""
    x = _array(x, np.uint16, "x", 2)
    w = _array(w, np.uint8, "w", 2)
    m, k = x.shape
    n = w.shape[0]
    if m < 1 or n < 1 or w.shape[1] != (q_row_bytes(qtype, k) or -1) and qtype in Q_LEGACY:
        raise ValueError(f"w must be [n >= 1, {q_row_bytes(qtype, k)}] bytes of type {qtype} for x {x.shape}, "
                         f"got {w.shape}")
    bias, add_to = _linear_extras(bias, add_to, y_f32, m, n)
    if _lib is None:
        return native_ref.q_linear(qtype, w, x, bias, y_f32, add_to)
    y, mode = _linear_y(add_to, y_f32, m, n)
    q_linear_ptr(qtype, w.ctypes.data, w.shape[1], n, k, x.ctypes.data, k, m,
                 0 if bias is None else bias.ctypes.data, y.ctypes.data, mode, n,
                 bf16_kernel() if kernel is None else kernel, 0, 1)
    return y


def q_supported(qtype: int) -> bool:
    """mb_q_linear runs this block type in this build (the K-quants need csrc/kquant.c)."""
    return _lib is not None and bool(_lib.mb_q_supported(qtype))


def q_vbmi_widening() -> int:
    """1: q_linear's KERNEL_AVX512BF16 widens Q8_0 through byte lookups (AVX512-VBMI) here;
    0: this CPU cannot; -1: this build has no AVX512 path (or no extension)."""
    return int(_lib.mb_q_vbmi_widening()) if _lib is not None else -1


def amx_supported() -> bool:
    """mb_q_linear_tiles runs here (AMX-BF16 tiles the OS lets this process use)."""
    return _lib is not None and bool(_lib.mb_amx_supported())


def q_linear_tiles_ptr(qtype: int, w: int, row_bytes: int, n: int, k: int, x: int, ldx: int, m: int,
                       bias: int, y: int, y_mode: int, ldy: int, parallel: int, threads: int) -> None:
    """mb_q_linear_tiles on addresses (0 for no bias / no parallel pool); see csrc/mashbox.h."""
    _prompt_ptr(_lib.mb_q_linear_tiles, "q_linear_tiles", (), qtype, w, row_bytes, n, k, x, ldx, m, bias, y,
                y_mode, ldy, parallel, threads)


def lanes_supported() -> bool:
    """mb_q_linear_lanes runs here (a CPU with AVX512-BF16, or AVX2 and FMA)."""
    return _lib is not None and bool(_lib.mb_lanes_supported())


def lanes_kernels() -> list[int]:
    """The kernels mb_q_linear_lanes takes here, fastest first: KERNEL_AVX512BF16 and
    KERNEL_AVX512BF16_INT32 where AVX512-BF16 runs, KERNEL_AVX2 where AVX2 and FMA do."""
    if _lib is None:
        return []
    fast = [KERNEL_AVX512BF16, KERNEL_AVX512BF16_INT32] if bf16_kernel() == KERNEL_AVX512BF16 else []
    return fast + ([KERNEL_AVX2] if avx2_supported() else [])


def q_linear_lanes_ptr(qtype: int, w: int, row_bytes: int, n: int, k: int, x: int, ldx: int, m: int,
                       bias: int, y: int, y_mode: int, ldy: int, kernel: int, parallel: int, threads: int) -> None:
    """mb_q_linear_lanes on addresses, as q_linear_tiles_ptr's; kernel KERNEL_AVX512BF16 (Q8_0
    through byte lookups where the CPU has VBMI), KERNEL_AVX512BF16_INT32 (through int32) or
    KERNEL_AVX2 (vdpbf16ps emulated by fused multiply-adds; the same bits)."""
    _prompt_ptr(_lib.mb_q_linear_lanes, "q_linear_lanes", (kernel,), qtype, w, row_bytes, n, k, x, ldx, m, bias, y,
                y_mode, ldy, parallel, threads)


def _prompt_ptr(fn, name: str, kernel: tuple, qtype: int, w: int, row_bytes: int, n: int, k: int, x: int,
                ldx: int, m: int, bias: int, y: int, y_mode: int, ldy: int, parallel: int, threads: int) -> None:
    """One of the prompt rules' C entries (mb_q_linear_tiles, mb_q_linear_lanes: the same
    arguments, and the lanes' kernel: `kernel`, () for none) on addresses."""
    _check(fn(qtype, _ffi.cast("uint8_t *", w), row_bytes, n, k, _ffi.cast("uint16_t *", x), ldx, m,
              _ffi.cast("float *", bias), _ffi.cast("void *", y), y_mode, ldy, *kernel,
              _ffi.cast("void *", parallel), threads), name)


def q_block_row_bytes(qtype: int, k: int) -> int:
    """Bytes of a k-element row of any GGUF block type the linears take (0: not one, or k
    not a whole number of its blocks)."""
    if qtype in native_ref.KQ_BLOCK_BYTES:
        return k // native_ref.KQ_BLOCK * native_ref.KQ_BLOCK_BYTES[qtype] if k > 0 and k % native_ref.KQ_BLOCK == 0 else 0
    return native_ref.q_row_bytes(qtype, k)


def q_linear_tiles(qtype: int, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
                   y_f32: bool = False, add_to: np.ndarray | None = None, parallel: int = 0,
                   threads: int = 1) -> np.ndarray:
    """native_ref.q_linear_tiles through the AMX kernel (where amx_supported(); else the
    reference): w uint8[n, row_bytes] blocks of any type q_linear takes, x uint16[m, k]."""
    return _q_prompt(amx_supported(), native_ref.q_linear_tiles, q_linear_tiles_ptr, (), qtype, w, x, bias, y_f32,
                     add_to, parallel, threads)


def q_linear_lanes(qtype: int, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
                   y_f32: bool = False, add_to: np.ndarray | None = None, parallel: int = 0,
                   threads: int = 1, kernel: int | None = None) -> np.ndarray:
    """native_ref.q_linear_lanes through the lanes kernel (where lanes_supported(); else
    the reference), as q_linear_tiles'; kernel as q_linear_lanes_ptr's (None: the fastest
    here, lanes_kernels()[0])."""
    if kernel is None:
        kernel = (lanes_kernels() or [KERNEL_AVX512BF16])[0]
    return _q_prompt(lanes_supported(), native_ref.q_linear_lanes, q_linear_lanes_ptr, (kernel,), qtype, w, x, bias,
                     y_f32, add_to, parallel, threads)


def _q_prompt(runs: bool, ref, ptr, kernel: tuple, qtype: int, w: np.ndarray, x: np.ndarray,
              bias: np.ndarray | None, y_f32: bool, add_to: np.ndarray | None, parallel: int,
              threads: int) -> np.ndarray:
    """A prompt rule on arrays: checked, then its kernel (ptr, with `kernel`'s arguments)
    where it runs, else ref."""
    x = _array(x, np.uint16, "x", 2)
    w = _array(w, np.uint8, "w", 2)
    m, k = x.shape
    n = w.shape[0]
    row_bytes = q_block_row_bytes(qtype, k)
    if m < 1 or n < 1 or row_bytes == 0 or w.shape[1] != row_bytes:
        raise ValueError(f"w must be [n >= 1, {row_bytes}] bytes of type {qtype} for x {x.shape}, got {w.shape}")
    bias, add_to = _linear_extras(bias, add_to, y_f32, m, n)
    if not runs:
        return ref(qtype, w, x, bias, y_f32, add_to)
    y, mode = _linear_y(add_to, y_f32, m, n)
    ptr(qtype, w.ctypes.data, row_bytes, n, k, x.ctypes.data, k, m,
        0 if bias is None else bias.ctypes.data, y.ctypes.data, mode, n, *kernel, parallel, threads)
    return y

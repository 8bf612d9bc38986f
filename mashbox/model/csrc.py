"""csrc's bfloat16 kernels on torch tensors: the one place a tensor becomes an address.

Rules:
- Every function checks its tensors before it takes their addresses: dtype, shape,
  unit stride along the row (and contiguity where C assumes it), the packed weight's
  byte size, int64 index tensors of the right length. A wrong one is a ValueError that
  names the argument; nothing wrong reaches C. C checks the lengths it is passed again
  (a status code out, raised by mashbox/native.py).
- The caller owns every output buffer; nothing here keeps an address past its call but
  LayerTable, which owns the tensors its C array points into (so they live as long as
  the array does).
- `kernel` is a native.KERNEL_*: KERNEL_PORTABLE runs on any CPU (the tests force it on
  machines without AVX512-BF16), KERNEL_AVX512BF16 where native.bf16_kernel() offers it.

Tensor shapes: x [M, k] rows any stride, unit stride along k; packed weights as
mb_bf16_pack lays them out; caches [slots, kv_heads, capacity, head_dim] contiguous.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Optional, Sequence

import torch

from mashbox import native

log = logging.getLogger(__name__)

Y_MODES = {native.Y_BF16: torch.bfloat16, native.Y_F32: torch.float32, native.Y_ADD_BF16: torch.bfloat16}


def _gomp_parallel() -> int:
    """Address of GOMP_parallel in the libgomp torch already loaded, or 0 (one thread)."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return 0
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return int(ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value or 0)
    except (OSError, AttributeError):
        return 0


_PARALLEL: Optional[int] = None


def parallel() -> int:
    """GOMP_parallel's address for csrc's kernels (looked up once), or 0: one thread."""
    global _PARALLEL
    if _PARALLEL is None:
        _PARALLEL = _gomp_parallel()
        if not _PARALLEL:
            log.warning("libgomp not found in this process: csrc's kernels run on one thread")
    return _PARALLEL


def _pool() -> int:
    """parallel(), without its call once looked up (the row ops run per layer)."""
    return _PARALLEL if _PARALLEL is not None else parallel()


def _rows(t: torch.Tensor, name: str, dtype: torch.dtype, width: int) -> None:
    """t is a 2-d CPU tensor of dtype, `width` wide, unit stride along the row."""
    if t.dtype != dtype or t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1 or t.device.type != "cpu":
        raise ValueError(f"{name} must be a 2-d {dtype} CPU tensor [rows, {width}] with unit stride "
                         f"along the row, got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")


def _vector(t: torch.Tensor, name: str, dtype: torch.dtype, length: int) -> None:
    if t.dtype != dtype or t.dim() != 1 or t.shape[0] != length or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor [{length}], "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def _cache(t: torch.Tensor, name: str, kv_heads: int, head_dim: int) -> None:
    if (t.dtype != torch.bfloat16 or t.dim() != 4 or tuple(t.shape[1:2]) + tuple(t.shape[3:]) != (kv_heads, head_dim)
            or not t.is_contiguous() or t.device.type != "cpu"):
        raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor [slots, {kv_heads}, capacity, "
                         f"{head_dim}], got {t.dtype} {tuple(t.shape)} on {t.device}")


def packed_bytes(n: int, k: int) -> int:
    """Bytes of a [n, k] weight's packed form; 0 when the kernel cannot take it (odd k)."""
    return native.bf16_packed_bytes(n, k)


def _packed(packed: torch.Tensor, n: int, k: int) -> None:
    nbytes = packed_bytes(n, k)
    if (nbytes == 0 or not packed.is_contiguous() or packed.device.type != "cpu"
            or packed.numel() * packed.element_size() != nbytes):
        raise ValueError(f"packed must be a contiguous CPU buffer of the {nbytes} bytes a [{n}, {k}] weight "
                         f"packs to, got {packed.numel() * packed.element_size()} bytes")


def pack(w: torch.Tensor, packed: torch.Tensor) -> None:
    """w [n, k] bfloat16 into packed (packed_bytes(n, k) bytes), mb_bf16_pack's layout."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or not w.is_contiguous() or w.device.type != "cpu":
        raise ValueError(f"w must be a contiguous 2-d bfloat16 CPU tensor, got {w.dtype} {tuple(w.shape)} on {w.device}")
    n, k = int(w.shape[0]), int(w.shape[1])
    _packed(packed, n, k)
    native.bf16_pack_ptr(w.data_ptr(), n, k, packed.data_ptr())


def _linear_out(x: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor, mode: int, n: int) -> int:
    """Checks a linear's bias float32 [n] and y [M, n] (as mode says) against x [M, k]; M."""
    if bias is not None:
        _vector(bias, "bias", torch.float32, n)
    dtype = Y_MODES.get(mode)
    if dtype is None:
        raise ValueError(f"mode must be one of native.Y_*, got {mode}")
    _rows(y, "y", dtype, n)
    m = int(x.shape[0])
    if y.shape[0] != m:
        raise ValueError(f"y must have {m} rows (x's), got {y.shape[0]}")
    return m


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, bias: Optional[torch.Tensor],
           y: torch.Tensor, mode: int, kernel: int) -> None:
    """y [M, n] (as mode says: native.Y_*) of x [M, k] bfloat16 and the packed [n, k]
    weight (+ bias float32 [n])."""
    _rows(x, "x", torch.bfloat16, k)
    _packed(packed, n, k)
    m = _linear_out(x, bias, y, mode, n)
    if m:
        native.bf16_linear_ptr(x.data_ptr(), x.stride(0), m, packed.data_ptr(), n, k,
                               0 if bias is None else bias.data_ptr(), y.data_ptr(), mode, y.stride(0),
                               kernel, _PARALLEL if _PARALLEL is not None else parallel(),
                               torch.get_num_threads())


def gather_rows(packed: torch.Tensor, n: int, k: int, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, k] bfloat16 = rows ids [T] (int64, each in [0, n)) of the packed [n, k] weight."""
    _packed(packed, n, k)
    _vector(ids, "ids", torch.int64, int(ids.shape[0]) if ids.dim() == 1 else -1)
    _rows(out, "out", torch.bfloat16, k)
    if not out.is_contiguous() or out.shape[0] != ids.shape[0]:
        raise ValueError(f"out must be contiguous [{ids.shape[0]}, {k}], got {tuple(out.shape)}")
    native.bf16_gather_rows_ptr(packed.data_ptr(), n, k, ids.data_ptr(), int(ids.shape[0]), out.data_ptr())


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out [M, k] bfloat16 = RMS norm of x [M, k] times w [k] (mb_bf16_rmsnorm)."""
    k = int(x.shape[-1])
    _rows(x, "x", torch.bfloat16, k)
    _vector(w, "w", torch.bfloat16, k)
    _rows(out, "out", torch.bfloat16, k)
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out must have {x.shape[0]} rows (x's), got {out.shape[0]}")
    native.bf16_rmsnorm_ptr(x.data_ptr(), x.stride(0), int(x.shape[0]), k, w.data_ptr(), eps,
                            out.data_ptr(), out.stride(0), _pool(), torch.get_num_threads())


def silu_mul(x: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, I] bfloat16 = silu(gate) * up of x [M, 2 I] ([gate | up]), rounded once."""
    width = int(x.shape[-1])
    if width < 2 or width % 2:
        raise ValueError(f"x must hold [gate | up] halves of equal width, got shape {tuple(x.shape)}")
    _rows(x, "x", torch.bfloat16, width)
    _rows(out, "out", torch.bfloat16, width // 2)
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out must have {x.shape[0]} rows (x's), got {out.shape[0]}")
    native.bf16_silu_mul_ptr(x.data_ptr(), x.stride(0), int(x.shape[0]), width // 2, out.data_ptr(), out.stride(0),
                             _pool(), torch.get_num_threads())


def rope_kv(qkv: torch.Tensor, tokens: int, heads: int, kv_heads: int, cos: torch.Tensor,
            sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Rotary embedding of q and k in the first `tokens` rows of qkv [T', (heads + 2
    kv_heads) * head_dim], q in place, k and v written into the caches at (slots[i], :,
    positions[i]) (mb_bf16_rope_kv); cos, sin [table rows, head_dim] contiguous."""
    head_dim = int(cos.shape[-1])
    _rows(qkv, "qkv", torch.bfloat16, (heads + 2 * kv_heads) * head_dim)
    if not 0 <= tokens <= qkv.shape[0]:
        raise ValueError(f"tokens must be in [0, {qkv.shape[0]}] (qkv's rows), got {tokens}")
    for name, table in (("cos", cos), ("sin", sin)):
        _rows(table, name, torch.bfloat16, head_dim)
        if not table.is_contiguous() or table.shape[0] != cos.shape[0]:
            raise ValueError(f"{name} must be contiguous [{cos.shape[0]}, {head_dim}], got {tuple(table.shape)}")
    _vector(positions, "positions", torch.int64, tokens)
    _vector(slots, "slots", torch.int64, tokens)
    _cache(k_cache, "k_cache", kv_heads, head_dim)
    _cache(v_cache, "v_cache", kv_heads, head_dim)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    native.bf16_rope_kv_ptr(
        qkv.data_ptr(), qkv.stride(0), tokens, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        int(k_cache.shape[0]), int(k_cache.shape[2]), int(cos.shape[0]), _pool(), torch.get_num_threads())


def _attention_operands(q: torch.Tensor, heads: int, kv_heads: int, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, out: torch.Tensor) -> int:
    """Checks the caches [slots, kv_heads, capacity, head_dim] (one shape), q [T, >= heads *
    head_dim] bfloat16 with unit stride along the row, and out's rows; head_dim."""
    head_dim = int(k_cache.shape[-1]) if k_cache.dim() == 4 else 0
    _cache(k_cache, "k_cache", kv_heads, head_dim)
    _cache(v_cache, "v_cache", kv_heads, head_dim)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dtype != torch.bfloat16 or q.dim() != 2 or q.stride(1) != 1 or q.shape[1] < heads * head_dim:
        raise ValueError(f"q must be a 2-d bfloat16 tensor [T, >= {heads * head_dim}] with unit stride along "
                         f"the row, got {q.dtype} {tuple(q.shape)} strides {q.stride()}")
    _rows(out, "out", torch.bfloat16, heads * head_dim)
    return head_dim


def attention(q: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, ends: torch.Tensor,
              heads: int, kv_heads: int, window: int, scale: float, k_cache: torch.Tensor,
              v_cache: torch.Tensor, out: torch.Tensor, kernel: int) -> None:
    """out[rows[i]] = attention of q[rows[i]] (q [T, >= heads * head_dim], unit stride
    along the row) over keys [lo, ends[i]) of slot slots[i] (mb_bf16_attention); out
    [T', heads * head_dim] contiguous."""
    head_dim = _attention_operands(q, heads, kv_heads, k_cache, v_cache, out)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    t = int(rows.shape[0])
    for name, a in (("rows", rows), ("slots", slots), ("ends", ends)):
        _vector(a, name, torch.int64, t)
    native.bf16_attention_ptr(
        q.data_ptr(), q.stride(0), int(q.shape[0]), rows.data_ptr(), slots.data_ptr(), ends.data_ptr(), t,
        heads, kv_heads, head_dim, window, scale, k_cache.data_ptr(), v_cache.data_ptr(),
        int(k_cache.shape[0]), int(k_cache.shape[2]), out.data_ptr(), int(out.shape[1]), kernel,
        parallel(), torch.get_num_threads())


def prefill_attention(q: torch.Tensor, firsts: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                      lens: torch.Tensor, heads: int, kv_heads: int, window: int, scale: float,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, kernel: int) -> None:
    """out[firsts[r] + i] = causal attention of q[firsts[r] + i] (q [T, >= heads * head_dim],
    unit stride along the row) at position starts[r] + i over slot slots[r]'s keys, for i
    < lens[r] (mb_bf16_prefill_attention); out [T', heads * head_dim] contiguous."""
    head_dim = _attention_operands(q, heads, kv_heads, k_cache, v_cache, out)
    if not out.is_contiguous() or out.shape[0] < q.shape[0]:
        raise ValueError(f"out must be contiguous with at least q's {q.shape[0]} rows")
    t = int(firsts.shape[0])
    for name, a in (("firsts", firsts), ("slots", slots), ("starts", starts), ("lens", lens)):
        _vector(a, name, torch.int64, t)
    native.bf16_prefill_attention_ptr(
        q.data_ptr(), q.stride(0), int(q.shape[0]), firsts.data_ptr(), slots.data_ptr(), starts.data_ptr(),
        lens.data_ptr(), t, heads, kv_heads, head_dim, window, scale, k_cache.data_ptr(), v_cache.data_ptr(),
        int(k_cache.shape[0]), int(k_cache.shape[2]), out.data_ptr(), int(out.shape[1]), kernel,
        parallel(), torch.get_num_threads())


class LayerTable:
    """The C array of struct mb_layer for mb_bf16_decode_layers, and the tensors it points
    into: one object owns both, so no address outlives its buffer. Made once per decoder.

    layers: one dict per layer of input_norm, post_norm (bfloat16 [hidden]); qkv, o,
    gate_up, down (packed int16 buffers, as mb_bf16_pack lays them out, with their [n, k]
    in `shapes`; or, where the dict has `<name>_type`, a GGUF block type, uint8 blocks
    [n, row_bytes] for mb_q_linear); qkv_bias, o_bias (float32 [n] or None). A layer with
    `v` (and `v_type`: blocks only) holds v apart: qkv is then q|k alone."""

    __slots__ = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "count", "_tensors", "array")

    def __init__(self, layers: Sequence[dict[str, Optional[torch.Tensor]]], hidden: int, heads: int,
                 kv_heads: int, head_dim: int, intermediate: int) -> None:
        self.hidden, self.heads, self.kv_heads = hidden, heads, kv_heads
        self.head_dim, self.intermediate = head_dim, intermediate
        qkv_n, q_size = (heads + 2 * kv_heads) * head_dim, heads * head_dim
        shapes = {"qkv": (qkv_n, hidden), "o": (hidden, q_size), "gate_up": (2 * intermediate, hidden),
                  "down": (hidden, intermediate)}
        biases = {"qkv_bias": qkv_n, "o_bias": hidden}
        self._tensors: list[torch.Tensor] = []
        entries = []
        kv_n = kv_heads * head_dim
        for i, layer in enumerate(layers):
            entry: dict[str, int] = {}
            for name in ("input_norm", "post_norm"):
                _vector(layer[name], f"layers[{i}].{name}", torch.bfloat16, hidden)
            own = dict(shapes)
            if layer.get("v") is not None:
                if not layer.get("v_type"):
                    raise ValueError(f"layers[{i}].v: a v apart is GGUF blocks (v_type)")
                own["qkv"], own["v"] = (qkv_n - kv_n, hidden), (kv_n, hidden)
            for name, (n, k) in own.items():
                qtype = int(layer.get(name + "_type") or 0)
                try:
                    if qtype:
                        entry[name + "_type"], entry[name + "_row_bytes"] = qtype, _blocks(layer[name], qtype, n, k)
                    else:
                        _packed(layer[name], n, k)
                except ValueError as exc:
                    raise ValueError(f"layers[{i}].{name}: {exc}") from None
            for name, n in biases.items():
                if layer.get(name) is not None:
                    _vector(layer[name], f"layers[{i}].{name}", torch.float32, n)
            for name, t in layer.items():
                if isinstance(t, torch.Tensor):
                    self._tensors.append(t)
                    entry[name] = t.data_ptr()
            entries.append(entry)
        self.count = len(entries)
        self.array = native.bf16_layers(entries)

    def scratch_elements(self, rows: int) -> int:
        """bfloat16 elements of scratch mb_bf16_decode_layers needs for `rows` rows (C's rule)."""
        return native.bf16_decode_scratch(rows, self.hidden, self.heads, self.kv_heads, self.head_dim,
                                          self.intermediate)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
               ends: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, window: int, scale: float,
               scratch: torch.Tensor, kernel: int) -> None:
        """Every layer on x [t, hidden] (contiguous bfloat16, updated in place) in one call;
        caches [layers, slots, kv_heads, capacity, head_dim]; scratch bfloat16, at least
        scratch_elements(t) of it (C checks)."""
        _rows(x, "x", torch.bfloat16, self.hidden)
        if not x.is_contiguous():
            raise ValueError("x must be contiguous")
        t = int(x.shape[0])
        for name, a in (("positions", positions), ("rows", rows), ("slots", slots), ("ends", ends)):
            _vector(a, name, torch.int64, t)
        for name, table in (("cos", cos), ("sin", sin)):
            _rows(table, name, torch.bfloat16, self.head_dim)
            if not table.is_contiguous() or table.shape[0] != cos.shape[0]:
                raise ValueError(f"{name} must be contiguous [{cos.shape[0]}, {self.head_dim}]")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dim() != 5 or c.shape[0] != self.count:
                raise ValueError(f"{name} must be [{self.count} layers, slots, kv_heads, capacity, head_dim], "
                                 f"got {tuple(c.shape)}")
            _cache(c[0], name, self.kv_heads, self.head_dim)
        if k_cache.shape != v_cache.shape:
            raise ValueError("k_cache and v_cache must have one shape")
        if scratch.dtype != torch.bfloat16 or not scratch.is_contiguous() or scratch.device.type != "cpu":
            raise ValueError("scratch must be a contiguous bfloat16 CPU tensor")
        native.bf16_decode_layers_ptr(
            self.array, self.count, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
            eps, x.data_ptr(), t, positions.data_ptr(), rows.data_ptr(), slots.data_ptr(), ends.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), int(cos.shape[0]), k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.stride(0), int(k_cache.shape[1]), int(k_cache.shape[3]), window, scale,
            scratch.data_ptr(), scratch.numel(), kernel, parallel(), torch.get_num_threads())


def _blocks(w: torch.Tensor, qtype: int, n: int, k: int) -> int:
    """w holds a [n, k] weight in GGUF blocks of qtype: its row bytes."""
    row_bytes = int(w.shape[1]) if w.dim() == 2 else -1
    legacy = native.q_row_bytes(qtype, k)
    if (w.dtype != torch.uint8 or w.dim() != 2 or w.shape[0] != n or not w.is_contiguous()
            or w.device.type != "cpu" or (legacy and row_bytes != legacy)):
        raise ValueError(f"w must be a contiguous uint8 CPU tensor [{n}, {legacy or 'row bytes'}] of type {qtype} "
                         f"blocks for k {k}, got {w.dtype} {tuple(w.shape)}")
    return row_bytes


def _q_call(qtype: int, w: torch.Tensor, n: int, k: int, x: torch.Tensor, bias: Optional[torch.Tensor],
            y: torch.Tensor, mode: int) -> Optional[tuple]:
    """The checked leading arguments of mb_q_linear, mb_q_linear_tiles and
    mb_q_linear_lanes (up to y's stride); None for no rows."""
    _rows(x, "x", torch.bfloat16, k)
    row_bytes = _blocks(w, qtype, n, k)
    m = _linear_out(x, bias, y, mode, n)
    if not m:
        return None
    return (qtype, w.data_ptr(), row_bytes, n, k, x.data_ptr(), x.stride(0), m,
            0 if bias is None else bias.data_ptr(), y.data_ptr(), mode, y.stride(0))


def q_linear(qtype: int, w: torch.Tensor, n: int, k: int, x: torch.Tensor, bias: Optional[torch.Tensor],
             y: torch.Tensor, mode: int, kernel: int) -> None:
    """y [M, n] (as mode says: native.Y_*) of x [M, k] bfloat16 and w, the [n, k] weight in
    GGUF blocks of qtype (uint8 [n, row_bytes], contiguous) (+ bias float32 [n])."""
    args = _q_call(qtype, w, n, k, x, bias, y, mode)
    if args:
        native.q_linear_ptr(*args, kernel, _PARALLEL if _PARALLEL is not None else parallel(), torch.get_num_threads())


def q_linear_tiles(qtype: int, w: torch.Tensor, n: int, k: int, x: torch.Tensor, bias: Optional[torch.Tensor],
                   y: torch.Tensor, mode: int, kernel: int) -> None:
    """q_linear's y by the tile rule on AMX tiles (csrc/amx.c): the prompt rows' kernel,
    where native.amx_supported(). kernel: the decode rows' (q_linear's); the tiles widen
    every block one way, whichever it is."""
    args = _q_call(qtype, w, n, k, x, bias, y, mode)
    if args:
        native.q_linear_tiles_ptr(*args, _PARALLEL if _PARALLEL is not None else parallel(), torch.get_num_threads())


def q_linear_lanes(qtype: int, w: torch.Tensor, n: int, k: int, x: torch.Tensor, bias: Optional[torch.Tensor],
                   y: torch.Tensor, mode: int, kernel: int) -> None:
    """q_linear's y by the lanes rule on vdpbf16ps lanes (csrc/lanes.c): the prompt rows'
    kernel where AMX tiles are missing, where native.lanes_supported(). kernel: the decode
    rows' (q_linear's): KERNEL_AVX2 runs the lanes' AVX2 path (vdpbf16ps emulated),
    KERNEL_AVX512BF16_INT32 widens Q8_0 through int32 here too, any other through byte
    lookups where the CPU has VBMI (the same bits each way)."""
    args = _q_call(qtype, w, n, k, x, bias, y, mode)
    if args:
        lanes = (kernel if kernel in (native.KERNEL_AVX512BF16_INT32, native.KERNEL_AVX2)
                 else native.KERNEL_AVX512BF16)
        native.q_linear_lanes_ptr(*args, lanes, _PARALLEL if _PARALLEL is not None else parallel(),
                                  torch.get_num_threads())

"""The forms a decoder's linear weight takes, each chosen once when the weight is packed
(decoder.py), each with the same two calls:

    w(x, prompt=()) -> y            x [M, in] -> [M, out] (+ bias)
    w.add_into(x, y, prompt=())     y [M, out] += x @ w.T (+ bias) in place: the residual add

prompt: the runs [t0, t1) of x's rows that are prompt rows (PromptRuns). A form with a
rule of its own for them (QuantLinear on AMX tiles or vdpbf16ps lanes) runs them by it and the other rows
by its decode rule; every other form has one rule for all rows and ignores it. A row's
bits then depend on its own kind only, never on its neighbours: a prompt token gets the
same bits however its prompt is chunked, a decode row the same in any batch.

- BF16Linear: mashbox's own bfloat16 kernel (csrc/linear.c, through model/csrc.py).
  Every output is one float32 accumulator over the inputs in a fixed order, so a row's
  result never depends on the other rows of its batch: no padding rows, no threshold
  where the bits change (oneDNN rounds one row differently from two). It reads the
  weight once per call for up to 8 rows at a time. Runs on torch's own OpenMP threads
  (libgomp's GOMP_parallel, found in the process), so no second thread pool competes for
  the cores. add_into adds in place, rounded once.
- QuantLinear: a GGUF weight kept in its file's quantized blocks (model/block_weight.py),
  on csrc's mb_q_linear (csrc/quant.c): the same calls, the same batch invariance, a
  fraction of the bytes per step; activations stay exact bfloat16. With a prompt rule
  (chosen once: model/kernels.py's prompt_linears), its prompt rows run on AMX tiles
  (csrc/amx.c's mb_q_linear_tiles: the tile rule, several times the speed at prefill)
  or, where tiles are missing, on vdpbf16ps lanes (csrc/lanes.c's mb_q_linear_lanes:
  the lanes rule, each output's blocks widened once per 512 rows instead of per few);
  either gives other bits than mb_q_linear's. Decode rows stay on mb_q_linear.
- QkvSplit: q|k|v of a GGUF whose v is in another block type than q and k (Q4_K_M: q, k
  Q4_K, v Q6_K): two QuantLinears writing their columns of one y, instead of one weight
  dequantized to bfloat16 (3.4x the bytes of its blocks, read every step).
- OneDNNLinear: the weight reordered once into oneDNN's blocked layout (a CPU with
  oneDNN): in bfloat16 each output bit-identical to F.linear's.
- TorchLinear: plain F.linear (CUDA, or a CPU without oneDNN).
- Int8Weight / Int4Weight: torch's weight-only quantized kernels (opt-in --weights).

Tensor shapes: weights [out, in]; x [M, in] with unit stride along in; y [M, out].
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from mashbox import native
from mashbox.model import csrc
from mashbox.model.block_weight import GGML_TYPES, BlockWeight

INT4_GROUP = 32  # GGUF Q4_0 / Q4_1 block: requantizing their weights at it is near exact

PromptRuns = tuple[tuple[int, int], ...]  # [t0, t1) runs of prompt rows, in order, disjoint
# QuantLinear's prompt rules: name -> (runs here?, the prompt rows' kernel or None), in
# the order Kernels' prompt_linears "auto" prefers them
PROMPT_RULES = {"amx": (native.amx_supported, csrc.q_linear_tiles),
                "lanes": (native.lanes_supported, csrc.q_linear_lanes), "same": (lambda: True, None)}


def bf16_kernel_available() -> bool:
    """The fast kernel runs on this CPU (AVX512-BF16); the portable one is for tests only."""
    return native.NATIVE and native.bf16_kernel() == native.KERNEL_AVX512BF16


def _check_residual(x: torch.Tensor, y: torch.Tensor, n: int) -> None:
    """add_into's y: contiguous bfloat16 [M, n] for x [M, in]."""
    if y.dtype != torch.bfloat16 or not y.is_contiguous() or tuple(y.shape) != (x.shape[0], n):
        raise ValueError(f"add_into needs a contiguous bfloat16 [{x.shape[0]}, {n}] y")


class BF16Linear:
    """A [out, in] bfloat16 weight (and float32 bias) packed once for mb_bf16_linear."""

    __slots__ = ("n", "k", "packed", "bias", "kernel")

    def __init__(self, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 kernel: Optional[int] = None, into: Optional[torch.Tensor] = None) -> None:
        """into: where the packed weight goes (packed_bytes(w) bytes of a WeightArena),
        else a buffer of its own. kernel: a native.KERNEL_* (default the fastest here)."""
        csrc.parallel()
        if w.dtype != torch.bfloat16 or w.dim() != 2 or w.device.type != "cpu":
            raise ValueError(f"BF16Linear takes a 2-d bfloat16 CPU weight, got {w.dtype} {tuple(w.shape)} on {w.device}")
        self.n, self.k = (int(s) for s in w.shape)
        nbytes = csrc.packed_bytes(self.n, self.k)
        if nbytes == 0:
            raise ValueError(f"BF16Linear needs an even input size, got {self.k}")
        if into is not None:
            if into.numel() * into.element_size() != nbytes:
                raise ValueError(f"BF16Linear: `into` holds {into.numel() * into.element_size()} bytes, "
                                 f"the weight packs to {nbytes}")
            self.packed = into.view(torch.int16)  # [tiles, in / 2, 48, 2]
        else:
            self.packed = torch.empty(nbytes // 2, dtype=torch.int16)
        csrc.pack(w.contiguous(), self.packed)
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()  # [out]
        self.kernel = native.bf16_kernel() if kernel is None else kernel

    @staticmethod
    def supports(w: torch.Tensor) -> bool:
        return w.dim() == 2 and w.shape[1] % 2 == 0

    @staticmethod
    def packed_bytes(w: torch.Tensor) -> int:
        return csrc.packed_bytes(int(w.shape[0]), int(w.shape[1]))

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, prompt: PromptRuns = ()) -> torch.Tensor:
        """x [M, in] bfloat16 -> [M, out] of out_dtype (bfloat16 or float32); one rule for
        every row (prompt ignored)."""
        y = torch.empty(x.shape[0], self.n, dtype=out_dtype)
        self._run(x, y, native.Y_F32 if out_dtype == torch.float32 else native.Y_BF16)
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ids [T] (int64) as [T, in] bfloat16: a tied embedding's lookup
        from the packed output head, so the plain copy need not be kept."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.k, dtype=torch.bfloat16)
        csrc.gather_rows(self.packed, self.n, self.k, ids, out)
        return out

    def add_into(self, x: torch.Tensor, y: torch.Tensor, prompt: PromptRuns = ()) -> None:
        """y [M, out] bfloat16, contiguous += x [M, in] @ w.T (+ bias), rounded once."""
        _check_residual(x, y, self.n)
        self._run(x, y, native.Y_ADD_BF16)

    def _run(self, x: torch.Tensor, y: torch.Tensor, mode: int) -> None:
        if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
            x = x.to(torch.bfloat16).contiguous()
        csrc.linear(x, self.packed, self.n, self.k, self.bias, y, mode, self.kernel)


class QuantLinear:
    """A [out, in] weight in GGUF blocks (copied once, into the arena when given) and its
    float32 bias, for mb_q_linear."""

    __slots__ = ("n", "k", "qtype", "blocks", "bias", "kernel", "prompt_kernel")

    def __init__(self, w: BlockWeight, bias: Optional[torch.Tensor] = None, kernel: Optional[int] = None,
                 into: Optional[torch.Tensor] = None, prompt_rule: str = "same") -> None:
        """into: where the blocks go (w.nbytes bytes of a WeightArena), else a copy of its own;
        prompt_rule: the prompt rows' rule, one of PROMPT_RULES ("amx": AMX tiles, needs
        native.amx_supported(); "lanes": vdpbf16ps lanes (emulated on AVX2), needs native.lanes_supported();
        "same": mb_q_linear's, as the decode rows')."""
        if prompt_rule not in PROMPT_RULES:
            raise ValueError(f"QuantLinear: prompt_rule must be one of {', '.join(PROMPT_RULES)}, not {prompt_rule!r}")
        if not PROMPT_RULES[prompt_rule][0]():
            raise ValueError(f"QuantLinear: prompt_rule {prompt_rule} does not run on this CPU")
        self.prompt_kernel = PROMPT_RULES[prompt_rule][1]  # None: one rule for every row
        csrc.parallel()
        self.n, self.k = w.shape
        self.qtype = w.qtype
        if into is not None:
            if into.numel() != w.nbytes:
                raise ValueError(f"QuantLinear: `into` holds {into.numel()} bytes, the blocks take {w.nbytes}")
            self.blocks = into.view(w.raw.shape)  # uint8 [out, row_bytes]
            self.blocks.copy_(w.raw)
        else:
            self.blocks = w.raw.contiguous().clone()
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()  # [out]
        self.kernel = native.bf16_kernel() if kernel is None else kernel

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, prompt: PromptRuns = ()) -> torch.Tensor:
        """x [M, in] bfloat16 -> [M, out] of out_dtype (bfloat16 or float32)."""
        y = torch.empty(x.shape[0], self.n, dtype=out_dtype)
        self._run(x, y, native.Y_F32 if out_dtype == torch.float32 else native.Y_BF16, prompt)
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ids [T] dequantized, [T, in] bfloat16: a tied embedding's lookup."""
        name = next(k for k, v in GGML_TYPES.items() if v == self.qtype)
        return BlockWeight(name, self.blocks, (self.n, self.k)).rows(ids.to(torch.int64), torch.bfloat16)

    def add_into(self, x: torch.Tensor, y: torch.Tensor, prompt: PromptRuns = ()) -> None:
        """y [M, out] bfloat16, contiguous += x [M, in] @ w.T (+ bias), rounded once."""
        _check_residual(x, y, self.n)
        self._run(x, y, native.Y_ADD_BF16, prompt)

    def _run(self, x: torch.Tensor, y: torch.Tensor, mode: int, prompt: PromptRuns = ()) -> None:
        """y's rows by their kind: the prompt runs by the prompt rule (where it has one), the
        rows between them on mb_q_linear; y [M, out] may be a column slice (QkvSplit's)."""
        if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
            x = x.to(torch.bfloat16).contiguous()
        runs, at, m = prompt if self.prompt_kernel is not None else (), 0, x.shape[0]
        for i, (t0, t1) in enumerate((*runs, (m, m))):  # (m, m): the rows after the last run
            if i < len(runs) and not at <= t0 < t1 <= m:
                raise ValueError(f"prompt runs must be ordered, disjoint and within {m} rows, got {prompt}")
            if t0 > at:
                csrc.q_linear(self.qtype, self.blocks, self.n, self.k, x[at:t0], self.bias, y[at:t0], mode, self.kernel)
            if t1 > t0:
                self.prompt_kernel(self.qtype, self.blocks, self.n, self.k, x[t0:t1], self.bias, y[t0:t1], mode,
                                   self.kernel)
            at = t1


class QkvSplit:
    """q|k [(heads + kv_heads) * head_dim, in] and v [kv_heads * head_dim, in] as two
    QuantLinears of their own block types; y's columns: q|k's, then v's. bias: the whole
    q|k|v bias (float32 [out]) or None; each part holds its slice."""

    __slots__ = ("qk", "v", "n", "k", "bias")

    def __init__(self, qk: BlockWeight, v: BlockWeight, bias: Optional[torch.Tensor] = None,
                 kernel: Optional[int] = None, into: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 prompt_rule: str = "same") -> None:
        """into: where each part's blocks go (qk.nbytes, v.nbytes bytes of a WeightArena);
        prompt_rule: as QuantLinear's."""
        if qk.shape[1] != v.shape[1]:
            raise ValueError(f"QkvSplit: q|k takes {qk.shape[1]} inputs, v {v.shape[1]}")
        nqk = qk.shape[0]
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()  # [out]
        parts = (None, None) if into is None else into
        self.qk = QuantLinear(qk, None if self.bias is None else self.bias[:nqk], kernel, parts[0], prompt_rule)
        self.v = QuantLinear(v, None if self.bias is None else self.bias[nqk:], kernel, parts[1], prompt_rule)
        self.n, self.k = nqk + v.shape[0], qk.shape[1]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, prompt: PromptRuns = ()) -> torch.Tensor:
        """x [M, in] bfloat16 -> [M, out] of out_dtype (bfloat16 or float32)."""
        y = torch.empty(x.shape[0], self.n, dtype=out_dtype)
        mode = native.Y_F32 if out_dtype == torch.float32 else native.Y_BF16
        self.qk._run(x, y[:, :self.qk.n], mode, prompt)
        self.v._run(x, y[:, self.qk.n:], mode, prompt)
        return y

    def add_into(self, x: torch.Tensor, y: torch.Tensor, prompt: PromptRuns = ()) -> None:
        """y [M, out] bfloat16, contiguous += x [M, in] @ w.T (+ bias), rounded once."""
        _check_residual(x, y, self.n)
        self.qk._run(x, y[:, :self.qk.n], native.Y_ADD_BF16, prompt)
        self.v._run(x, y[:, self.qk.n:], native.Y_ADD_BF16, prompt)


class OneDNNLinear:
    """A weight reordered once into oneDNN's blocked layout, and its bias."""

    __slots__ = ("packed", "bias")

    def __init__(self, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        self.bias = bias

    def __call__(self, x: torch.Tensor, prompt: PromptRuns = ()) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    def add_into(self, x: torch.Tensor, y: torch.Tensor, prompt: PromptRuns = ()) -> None:
        y.add_(self(x))  # the same rounding as y + self(x)


class TorchLinear:
    """A plain [out, in] weight for F.linear, and its bias."""

    __slots__ = ("weight", "bias")

    def __init__(self, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        self.weight = w
        self.bias = bias

    def __call__(self, x: torch.Tensor, prompt: PromptRuns = ()) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_into(self, x: torch.Tensor, y: torch.Tensor, prompt: PromptRuns = ()) -> None:
        y.add_(self(x))  # the same rounding as y + self(x)


@dataclass(slots=True)
class Int8Weight:
    """Weight-only int8, symmetric per output row: w ~= q * scale."""
    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] model dtype
    bias: Optional[torch.Tensor] = None  # [out] model dtype, added after the product

    @classmethod
    def of(cls, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "Int8Weight":
        scale = (w.float().abs().amax(dim=1) / 127).clamp_(min=1e-12)  # [out]
        q = (w.float() / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return cls(q, scale.to(w.dtype), bias)

    def __call__(self, x: torch.Tensor, prompt: PromptRuns = ()) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias

    def add_into(self, x: torch.Tensor, y: torch.Tensor, prompt: PromptRuns = ()) -> None:
        y.add_(self(x))  # the same rounding as y + self(x)


@dataclass(slots=True)
class Int4Weight:
    """Weight-only int4, asymmetric per group of INT4_GROUP inputs: w ~= q * d + min, q in
    [0, 15] (GGUF Q4_1's form), stored as torch's CPU int4 pack; the kernel computes
    (q - 8) * scale + zero, so zero = min + 8 d."""
    packed: torch.Tensor
    scale_zero: torch.Tensor  # [in / group, out, 2] model dtype
    bias: Optional[torch.Tensor] = None  # [out] model dtype, added after the product

    @classmethod
    def of(cls, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "Int4Weight":
        out, inp = w.shape
        g = w.float().view(out, inp // INT4_GROUP, INT4_GROUP)  # [out, groups, group]
        lo = g.amin(dim=-1)
        d = ((g.amax(dim=-1) - lo) / 15).clamp_(min=1e-12)  # [out, groups]
        q = ((g - lo[..., None]) / d[..., None]).round_().clamp_(0, 15).to(torch.int32).view(out, inp)
        scale_zero = torch.stack([d, lo + 8 * d], dim=-1).transpose(0, 1).contiguous().to(w.dtype)
        return cls(torch._convert_weight_to_int4pack_for_cpu(q, 1), scale_zero, bias)

    def __call__(self, x: torch.Tensor, prompt: PromptRuns = ()) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scale_zero)
        return y if self.bias is None else y + self.bias

    def add_into(self, x: torch.Tensor, y: torch.Tensor, prompt: PromptRuns = ()) -> None:
        y.add_(self(x))  # the same rounding as y + self(x)


Linear = Union[BF16Linear, QuantLinear, QkvSplit, OneDNNLinear, TorchLinear, Int8Weight, Int4Weight]

HUGE_PAGE = 2 << 20
HUGE_PAGES = True  # a switch for benchmarks: the arena asks for transparent huge pages


class WeightArena:
    """One buffer for every packed weight of a model, handed out in the order the decoder
    reads them, and (on Linux) backed by transparent huge pages: a decode step streams
    all of it, and with 4 KiB pages it walks 65k page-table entries per step for the
    default model (README, speed: the measured difference)."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched until packed
        base = self.buffer.data_ptr()
        self.offset = (-base) % HUGE_PAGE  # start on a huge-page boundary
        self.end = self.offset + nbytes
        self.huge = HUGE_PAGES and _advise_huge_pages(base + self.offset, nbytes)

    def take(self, nbytes: int) -> torch.Tensor:
        if self.offset + nbytes > self.end:
            raise ValueError("WeightArena: more bytes taken than it was made for")
        part = self.buffer[self.offset:self.offset + nbytes]
        self.offset += nbytes + (-nbytes) % 64  # each weight on a cache line
        return part


def arena_bytes(sizes: list[int]) -> int:
    """What a WeightArena needs for weights of these packed sizes (cache-line aligned)."""
    return sum(n + (-n) % 64 for n in sizes)


def _advise_huge_pages(address: int, nbytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) before the first touch; False where it is not offered."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), 14) == 0  # MADV_HUGEPAGE
    except (OSError, AttributeError):
        return False

"""AttentionPlan: one forward's attention, planned once and run by every layer.

Rules (decoder.py's docstring states why):
- Decode rows (Batch.row_decode) on csrc's kernel (model/attention.py) where the
  decoder chose it: each query alone over its own keys, one call for all of them; every
  other row on csrc's prefill kernel where the decoder chose it (one call for all).
- Batch-invariant mode (the CPU default): every other row, prefill chunk or decode,
  attends through one masked SDPA call over its slot's keys [0, key_width(end)), its
  queries padded (padded_queries) so SDPA's gemms never see fewer rows than the dtype's
  small-M threshold. One-token rows of the same key width share one call
  (_DecodeGroup), whose batch runs each slot's queries through the blocks a call of its
  own would.
- Otherwise (CUDA) plain causal prefills, and decode rows whose slots cover a compact
  range attend in one SDPA call over a view of that range, padded keys masked.
- SDPA gets 4-d tensors throughout (on CPU the 3-d form falls back to the slow math
  kernel) and additive masks in the model dtype, filled once per forward (SDPA on CPU
  converts a bool mask on every call, which costs more than the attention itself for
  short rows). They depend on the step's positions, so each forward fills them in place
  in a MaskArena that the decoder made once (grown only when a step needs more); the
  plan's index tensors and the decode groups' padded queries are views of it too.

Tensor shapes: q [T, heads, head_dim]; caches [slots, kv_heads, capacity, head_dim];
out [T, heads * head_dim].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from mashbox.model import attention
from mashbox.model.kv_cache import KVCache, key_width
from mashbox.model.model_config import ModelConfig

# SDPA's q.k and p.v gemms on CPU give other bits for query blocks of fewer than 4 rows
# (both dtypes; measured, see decoder.py's notes on batch invariance)
_QUERY_MULTIPLE = {torch.float32: 4, torch.bfloat16: 4}


def padded_queries(n: int, group: int, multiple: int) -> int:
    """Queries of a row after padding, so that SDPA's query blocks (32, 64, 128 or 256 rows
    of group * queries) all hold at least `multiple` rows: group * padded is at least
    `multiple`, and past one block of 32 a multiple of it."""
    padded = max(n, -(-multiple // group))
    if group * padded > 32:
        while (group * padded) % multiple:
            padded += 1
    return padded


def _grown(buf: torch.Tensor, need: int) -> torch.Tensor:
    """buf, or a new buffer of max(need, 2 * its size) where it is too small; views
    already handed out keep the old buffer alive until their plan is gone."""
    return buf if buf.numel() >= need else torch.empty(max(need, 2 * buf.numel()), dtype=buf.dtype,
                                                       device=buf.device)


class _Stack:
    """One flat buffer handed out front to back (take), from its start again after reset()."""

    __slots__ = ("buf", "used")

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.buf, self.used = torch.empty(0, dtype=dtype, device=device), 0

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        self.buf = _grown(self.buf, self.used + numel)
        view = self.buf[self.used:self.used + numel].view(shape)
        self.used += numel
        return view


class MaskArena:
    """The memory of the SDPA path's additive masks, made once per decoder: a flat buffer in
    the model dtype, bool and int64 scratch, the key positions 0, 1, 2, ..., and a second
    model-dtype buffer for padded queries; each grown (doubled) only when a step needs more
    than any before. A plan's masks, indexes and queries are consecutive views of it,
    filled in place (reset() at each plan: the previous forward is done)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._add, self._q = _Stack(dtype, device), _Stack(dtype, device)  # masks, padded queries
        self._ints = _Stack(torch.int64, device)
        self._bad = torch.empty(0, dtype=torch.bool, device=device)
        self._side = torch.empty(0, dtype=torch.bool, device=device)
        self._pos = torch.arange(0, dtype=torch.int64, device=device)

    def reset(self) -> None:
        self._add.used = self._q.used = self._ints.used = 0

    def positions(self, lo: int, n: int) -> torch.Tensor:
        """[n] int64 view: lo, lo + 1, ..."""
        if self._pos.numel() < lo + n:
            self._pos = torch.arange(max(lo + n, 2 * self._pos.numel()), dtype=torch.int64, device=self.device)
        return self._pos[lo:lo + n]

    def ints(self, n: int) -> torch.Tensor:
        """[n] int64 view of scratch, this plan's own until reset()."""
        return self._ints.take((n,))

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed model-dtype view of `shape` (padded queries), this plan's own until reset()."""
        return self._q.take(shape).zero_()

    def values(self, values: list[int]) -> torch.Tensor:
        """ints(len(values)) holding values."""
        view = self.ints(len(values))
        if view.device.type == "cpu":
            view.numpy()[:] = values
        else:
            view.copy_(torch.tensor(values, dtype=torch.int64), non_blocking=True)
        return view

    def fill(self, shape: tuple[int, ...], qpos: torch.Tensor, k0: int, keys: int, window: Optional[int],
             bad_view: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """A mask of `shape` from this arena: 0 where query i (at position qpos[i]) may see
        key k0 + j (k0 + j <= qpos[i], and > qpos[i] - window with a window), else -inf;
        the [len(qpos), keys] rule broadcast over shape (viewed as bad_view first)."""
        rows = int(qpos.shape[0])
        self._bad = _grown(self._bad, rows * keys)
        bad = self._bad[:rows * keys].view(rows, keys)  # scratch: used up before the next fill
        kpos = self.positions(k0, keys).unsqueeze(0)  # [1, keys]
        torch.gt(kpos, qpos.unsqueeze(1), out=bad)  # keys past the query
        if window is not None:
            self._side = _grown(self._side, rows * keys)
            side = self._side[:rows * keys].view(rows, keys)
            torch.le(kpos, torch.sub(qpos, window, out=self.ints(rows)).unsqueeze(1), out=side)
            bad.logical_or_(side)
        out = self._add.take(shape)
        out.zero_().masked_fill_(bad if bad_view is None else bad.view(bad_view), float("-inf"))
        return out


@dataclass(slots=True)
class _DecodeGroup:
    """One-token rows attending in one SDPA call (batch-invariant mode)."""
    keys: int  # key width of every row in the group
    lo: int  # slot range [lo, hi) when compact
    hi: int
    dense: bool  # rows i = tokens i = slots lo + i
    gather: Optional[torch.Tensor]  # [rows] slots, when the range is not compact
    tokens: torch.Tensor  # [rows] token index of each row in the batch
    index: torch.Tensor  # [rows] each row's place in the call's batch
    queries: torch.Tensor  # [span, kv_heads, group, padded, head_dim], zeroed in the MaskArena
    mask: torch.Tensor  # [span, 1, group * padded, keys] additive


class AttentionPlan:
    """One forward's attention plan: index tensors and masks shared by every layer.

    invariant: every row (prefill chunk or decode) takes one code path: masked SDPA over
    the slot's keys [0, key_width(end)), its queries padded to the dtype's
    multiple, so a query's result depends only on its own keys and position. Otherwise
    plain causal prefills, and decode rows over compact slot ranges batched in one call.
    """

    def __init__(self, batch, cache: KVCache, c: ModelConfig, dtype: torch.dtype,
                 device: torch.device, invariant: bool, decode_kernel: int = 0, prefill_kernel: int = 0,
                 index: Optional[attention.RowIndex] = None, masks: Optional[MaskArena] = None):
        """batch: decoder.Batch; decode_kernel: a native.KERNEL_* for the decode rows on csrc's
        attention (model/attention.py), 0: they take SDPA too; prefill_kernel: the same for
        every other row; index, masks: the decoder's attention.RowIndex and MaskArena (fresh
        ones if None)."""
        own_decode = bool(decode_kernel)
        self.dtype = dtype
        self.masks = MaskArena(dtype, device) if masks is None else masks
        self.masks.reset()
        arena = self.masks
        rows = len(batch.row_slots)
        if not (rows == len(batch.row_starts) == len(batch.row_lens)) or rows == 0:
            raise ValueError("batch rows: row_slots, row_starts and row_lens must be non-empty and equal in length")
        if batch.row_decode and len(batch.row_decode) != rows:
            raise ValueError("batch rows: row_decode must be empty or have one flag per row")
        T = int(batch.input_ids.shape[0])
        if sum(batch.row_lens) != T or batch.positions.shape[0] != T:
            raise ValueError("batch: sum(row_lens) must equal len(input_ids) and len(positions)")
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.group = c.num_heads // c.num_kv_heads
        window = c.sliding_window
        token_slots: list[int] = []
        last: list[int] = []
        self.window = window
        # (t0, n, slot, first key, end key, additive mask [n, end - first] or None for plain causal)
        self.prefills: list[tuple[int, int, int, int, int, Optional[torch.Tensor]]] = []
        # invariant mode: (t0, n, padded n, slot, keys, additive mask [1, 1, padded n, keys])
        self.rows: list[tuple[int, int, int, int, int, torch.Tensor]] = []
        decodes: list[tuple[int, int, int]] = []  # (t, slot, length)
        invariant_decodes: list[tuple[int, int, int]] = []  # (t, slot, length)
        own: list[tuple[int, int, int]] = []  # (t, slot, length): decode rows on attention.py's kernel
        own_prefill: list[tuple[int, int, int, int]] = []  # (t0, slot, start, n): prompt rows on it
        qmult = _QUERY_MULTIPLE.get(dtype, 1)
        t0 = 0
        for i, (slot, start, n) in enumerate(zip(batch.row_slots, batch.row_starts, batch.row_lens)):
            if n < 1 or start < 0 or start + n > cache.ctx or not 0 <= slot < cache.slots:
                raise ValueError(f"batch row (slot {slot}, start {start}, len {n}) does not fit the cache "
                                 f"({cache.slots} slots of {cache.ctx})")
            decode = bool(batch.row_decode) and bool(batch.row_decode[i])
            if decode and n != 1:
                raise ValueError(f"batch row {i}: a decode row feeds one token, not {n}")
            token_slots.extend([slot] * n)
            last.append(t0 + n - 1)
            end = start + n
            if decode and own_decode:
                own.append((t0, slot, end))
            elif not decode and prefill_kernel:
                own_prefill.append((t0, slot, start, n))
            elif invariant and n == 1:
                invariant_decodes.append((t0, slot, end))
            elif invariant:
                keys = key_width(end)
                padded = padded_queries(n, self.group, qmult)
                # padding queries repeat the last one's position (their output is dropped)
                qpos = torch.clamp(arena.positions(start, padded), max=end - 1, out=arena.ints(padded))
                # query row (g, i): position i
                mask = arena.fill((self.group, padded, keys), qpos, 0, keys, window)
                self.rows.append((t0, n, padded, slot, keys, mask.view(1, 1, self.group * padded, keys)))
            elif n == 1:
                decodes.append((t0, slot, end))
            else:
                lo = 0 if window is None else max(0, start + 1 - window)
                mask = None
                if start > 0 or lo > 0 or (window is not None and n > window):
                    mask = arena.fill((n, end - lo), arena.positions(start, n), lo, end - lo, window)  # [n, L]
                self.prefills.append((t0, n, slot, lo, end, mask))
            t0 += n
        self.token_slots = arena.values(token_slots)  # [T]
        self.last_tokens = arena.values(last)  # [rows]
        self.decodes = decodes
        index = attention.RowIndex() if index is None else index
        self.own = attention.DecodeRows(own, c, decode_kernel, index) if own else None
        self.own_prefill = attention.PrefillRows(own_prefill, c, prefill_kernel, index) if own_prefill else None
        self.batched = None
        self.groups: list[_DecodeGroup] = []
        if invariant_decodes:
            self._group_decodes(invariant_decodes, window, padded_queries(1, self.group, qmult))
        if not invariant:
            self._plan_decodes(decodes, window)

    def _group_decodes(self, decodes: list[tuple[int, int, int]], window: Optional[int], padded: int) -> None:
        """Invariant mode's one-token rows, one SDPA call per key width: the call's batch
        runs each slot's queries through the same blocks as a call of its own, so a row
        gets the same bits alone or in company (tests/model/test_decoder_invariance.py).
        The K/V are a view of the slot range when it is compact (slots in it without a
        row attend to key 0 and are dropped), else gathered."""
        by_keys: dict[int, list[tuple[int, int, int]]] = {}
        for t, slot, end in decodes:
            by_keys.setdefault(key_width(end), []).append((t, slot, end))
        KV, G, D = self.kv_heads, self.group, self.head_dim
        for keys, rows in sorted(by_keys.items()):
            rows.sort(key=lambda r: r[1])
            slots = [r[1] for r in rows]
            lo, hi = slots[0], slots[-1] + 1
            compact = hi - lo <= 2 * len(rows)
            span = hi - lo if compact else len(rows)
            index = [s - lo for s in slots] if compact else list(range(len(rows)))
            # each slot's query position: its row's, or 0 for a spare slot in the range (key 0 only)
            qpos = [0] * span
            for i, (_, _, end) in zip(index, rows):
                qpos[i] = end - 1
            # [span, 1, group * padded, keys]: every query of a slot at its row's position
            mask = self.masks.fill((span, 1, G * padded, keys), self.masks.values(qpos), 0, keys, window,
                                   bad_view=(span, 1, 1, keys))
            tokens = [r[0] for r in rows]
            # the common case: the step's tokens 0..rows-1 fill slots lo..hi in order, so
            # queries and outputs move by views instead of index ops
            dense = tokens == index == list(range(len(rows)))
            self.groups.append(_DecodeGroup(
                keys=keys, lo=lo, hi=hi, dense=dense,
                gather=None if compact else self.masks.values(slots),
                tokens=self.masks.values(tokens),  # [rows]
                index=self.masks.values(index),  # [rows] each row's place in the call
                queries=self.masks.zeros((span, KV, G, padded, D)),
                mask=mask))

    def _plan_decodes(self, decodes: list[tuple[int, int, int]], window: Optional[int]) -> None:
        """Batch the decode rows when their slots are distinct and cover a compact range."""
        if len(decodes) < 2:
            return
        slots = [d[1] for d in decodes]
        lo_slot, hi_slot = min(slots), max(slots) + 1
        if len(set(slots)) != len(slots) or hi_slot - lo_slot > 2 * len(slots):
            return
        lengths = [d[2] for d in decodes]
        kv_len = max(lengths)
        kv_lo = 0 if window is None else max(0, min(lengths) - window)
        span = hi_slot - lo_slot
        # [span, 1, 1, kv_len - kv_lo]: 0 where a slot's row may attend; slots in the range
        # without a row attend to key kv_lo only (their output is dropped).
        qpos = [kv_lo] * span
        for _, slot, length in decodes:
            qpos[slot - lo_slot] = length - 1
        mask = self.masks.fill((span, 1, 1, kv_len - kv_lo), self.masks.values(qpos), kv_lo, kv_len - kv_lo, window,
                               bad_view=(span, 1, 1, kv_len - kv_lo))
        token_of_slot = [0] * span
        for t, slot, _ in decodes:
            token_of_slot[slot - lo_slot] = t
        in_range = sorted(slot - lo_slot for _, slot, _ in decodes)
        self.batched = (
            lo_slot, hi_slot, kv_lo, kv_len,
            mask,
            self.masks.values(token_of_slot),  # [span] the token of each slot in range (0 if none)
            self.masks.values(in_range),  # [decodes] range index of each row
            self.masks.values([token_of_slot[i] for i in in_range]),  # [decodes] their tokens
        )

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        """q [T, heads, head_dim]; caches [slots, kv_heads, ctx, head_dim]; out [T, heads*head_dim]."""
        KV, G, D = self.kv_heads, self.group, self.head_dim
        if self.own is not None:
            self.own.attend(q, k_cache, v_cache, out)
        if self.own_prefill is not None:
            self.own_prefill.attend(q, k_cache, v_cache, out)
        # SDPA gets 4-d tensors throughout: on CPU the 3-d form falls back to the slow
        # math kernel.
        for g in self.groups:
            span, padded = g.queries.shape[0], g.queries.shape[3]
            # padding queries stay zero, as _padded_queries' F.pad makes them
            if g.dense:
                g.queries[:, :, :, 0] = q[:span].view(span, KV, G, D)
            else:
                g.queries[g.index, :, :, 0] = q[g.tokens].view(-1, KV, G, D)
            if g.gather is None:
                kb, vb = k_cache[g.lo:g.hi, :, :g.keys], v_cache[g.lo:g.hi, :, :g.keys]
            else:
                kb, vb = k_cache[g.gather, :, :g.keys], v_cache[g.gather, :, :g.keys]
            o = F.scaled_dot_product_attention(g.queries.view(span, KV, G * padded, D), kb, vb,
                                               attn_mask=g.mask)  # [span, kv_heads, group * padded, head_dim]
            if g.dense:
                out[:span].view(span, KV, G, D).copy_(o.view(span, KV, G, padded, D)[:, :, :, 0])
            else:
                out[g.tokens] = o.view(span, KV, G, padded, D)[g.index, :, :, 0].reshape(-1, KV * G * D)
        for t0, n, padded, slot, keys, mask in self.rows:
            # the group's query heads share their K/V head: [1, kv_heads, group * padded, head_dim]
            qr = q[t0:t0 + n].view(n, KV, G, D).permute(1, 2, 0, 3)  # [kv_heads, group, n, head_dim]
            if padded > n:
                qr = F.pad(qr, (0, 0, 0, padded - n))
            o = F.scaled_dot_product_attention(
                qr.reshape(1, KV, G * padded, D), k_cache[slot:slot + 1, :, :keys],
                v_cache[slot:slot + 1, :, :keys], attn_mask=mask)  # [1, kv_heads, group * padded, head_dim]
            out[t0:t0 + n] = o.view(KV, G, padded, D)[:, :, :n].permute(2, 0, 1, 3).reshape(n, -1)
        for t0, n, slot, lo, end_len, mask in self.prefills:
            qr = q[t0:t0 + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
            kr = k_cache[slot:slot + 1, :, lo:end_len]  # [1, kv_heads, L, head_dim]
            vr = v_cache[slot:slot + 1, :, lo:end_len]
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=G > 1)  # [1, heads, n, head_dim]
            out[t0:t0 + n] = o[0].transpose(0, 1).reshape(n, -1)
        if self.batched is not None:
            lo_slot, hi_slot, kv_lo, kv_len, mask, token_of_slot, rows_in_range, row_tokens = self.batched
            span = hi_slot - lo_slot
            qb = q[token_of_slot].view(span, KV, G, D)  # [span, kv_heads, group, head_dim]
            kb = k_cache[lo_slot:hi_slot, :, kv_lo:kv_len]  # [span, kv_heads, L, head_dim] (a view)
            vb = v_cache[lo_slot:hi_slot, :, kv_lo:kv_len]
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)  # [span, kv_heads, group, head_dim]
            out[row_tokens] = o[rows_in_range].reshape(-1, KV * G * D)
            return
        for t, slot, length in self.decodes:
            lo = self._decode_lo(length)
            qr = q[t].view(1, KV, G, D)  # the group's query heads share their K/V head
            o = F.scaled_dot_product_attention(qr, k_cache[slot:slot + 1, :, lo:length],
                                               v_cache[slot:slot + 1, :, lo:length])
            out[t] = o.reshape(-1)

    def _decode_lo(self, length: int) -> int:
        return 0 if self.window is None else max(0, length - self.window)



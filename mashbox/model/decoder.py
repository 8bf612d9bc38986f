"""Decoder: the forward pass of a Llama / Mistral / Qwen2 / Qwen3 decoder over a varlen batch.

Rules:
- One code path for all four architectures; config flags select the differences
  (qk_norm, attention biases, tied embeddings, rope scaling, sliding window).
- A Batch is a flattened varlen batch: rows (one per slot) of new tokens, concatenated.
  A row is either a prefill chunk (row_len > 1, maybe continuing an earlier chunk) or a
  single-token decode; rows sit at different positions in different slots.
- forward() writes each new token's K/V into its slot at its position, attends over the
  slot's cache [0, row_start + row_len), and returns float32 logits of each row's last
  token only: the output head never runs on the other prefill tokens.
- Weights are fused: q|k|v into one matrix, gate|up into one. The loader already
  places the parts side by side (fused_layout.py), so fusing is a view; parts from
  elsewhere are concatenated. The Decoder takes ownership of the `tensors` dict and
  empties it, so unfused parts are freed as the fused ones are built.
- On CPU, linear weights are packed once (_pack_weights): bfloat16 for mashbox's own
  kernel where the CPU has AVX512-BF16 (model/linear.py), else for oneDNN;
  weights="int8" / "int4" opts into weight-only quantized linears (bf16). On the own
  kernel's path the RMS norms, rope with the K/V cache write, and the residual adds run
  in csrc too (one call each instead of several torch ops); float32 keeps torch's ops,
  which the transformers parity tests compare.
- Decode rows (Batch.row_decode: the row feeds a token the model generated) attend on
  csrc's kernel (model/attention.py) in bfloat16 where the CPU runs it: one call per
  layer for all of them, each query alone over its own keys. Prompt rows, and decode rows
  elsewhere, attend through SDPA. A step whose rows all decode that way runs every layer
  in one csrc call (csrc/layers.c: the same calls as the loop below, in its order, so the
  same bits). Measured on this project's CPU, default model, batch-1 decode in
  consecutive runs: SDPA and the Python loop 113 tok/s, csrc's attention 128, the
  layers in one call 150-157.
- GQA never materialises repeated K/V: a row's q is viewed as [kv_heads, group * n,
  head_dim] against the slot's [kv_heads, L, head_dim] keys (batch_invariant), or prefill
  uses SDPA's enable_gqa.
- Batch invariance: with batch_invariant (the default on CPU) a token's logits do not
  depend on how its request was scheduled: whole or chunked prefill, its last prompt
  token recomputed alone after a prefix-cache hit, alone or beside other rows, in
  bfloat16 and float32 (bit-identical; measured on this project's CPU, see _MIN_ROWS).
  Decode rows on csrc's attention depend on their own query and keys only. Elsewhere
  three rules make it so: every row, prefill chunk or decode, attends through one masked
  SDPA call over its slot's keys [0, kv_cache.key_width(end)): 128, or whole blocks of
  512 (masked keys add exact zeros); its queries are padded so SDPA's gemms never see fewer rows than the dtype's
  small-M threshold; and linears run on at least _MIN_ROWS rows (padding rows otherwise;
  the own kernel needs none: its rows never meet). One-token rows of the same key width
  share one SDPA call (_DecodeGroup): the call's batch runs each slot's queries through
  the blocks a call of its own would. Where decode rows take csrc's attention and prompt
  rows SDPA, a generated token's K/V can differ in its last bits from the same token's
  computed as part of a later prompt that misses the prefix cache; a hit reuses the
  generated token's own K/V.
  Cost, bf16, 1 thread, against the same code reading keys in blocks of 64 (which is not
  invariant): nothing up to 128 keys; at 300 keys about +0.7 ms per decode row (512 keys
  read; batch 8: 34.7 -> 40.4 ms per step). A sliding-window model reads keys from 0
  too (masked outside its window). Against the decoder before this work (not invariant), with packed linears:
  batch-1 decode 29% faster, batch 8 13% slower at 300 keys, prefill unchanged.
  Without batch_invariant (the default on CUDA, where kernel launches dominate) decode
  rows whose slots cover a compact range attend in one SDPA call over a view of that
  range, padded keys masked, and prefill chunks use plain causal attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from mashbox import native
from mashbox.model.device import device_and_dtype  # noqa: F401  (contract: decoder.device_and_dtype)
from mashbox.model.errors import ModelError
from mashbox.model.fused_layout import fuse
from mashbox.model.kv_cache import KVCache, key_width
from mashbox.model import attention, linear
from mashbox.model.linear import INT4_GROUP, BF16Linear, Int4Weight, Int8Weight, bf16_kernel_available
from mashbox.model.model_config import ModelConfig
from mashbox.model.rope import RopeTable


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64, the new tokens of all rows concatenated
    positions: torch.Tensor  # [T] int64, each token's position in its slot
    row_slots: list[int]  # [rows] the KV slot of each row
    row_starts: list[int]  # [rows] tokens already in the slot = position of the row's first token
    row_lens: list[int]  # [rows] new tokens of the row (1 = decode)
    # [rows] True where the row feeds a token the model generated (a decode step), not a
    # prompt token; empty: none does. Decode rows may attend on their own kernel
    # (model/attention.py), so a prompt's last token recomputed alone must say it is one.
    row_decode: tuple[bool, ...] = ()

    @classmethod
    def build(cls, rows: list[tuple[int, int, list[int]]], device: torch.device | str = "cpu",
              decode: tuple[bool, ...] = ()) -> "Batch":
        """From (slot, start, new token ids) per row; a convenience for callers and tests."""
        ids: list[int] = []
        pos: list[int] = []
        for _, start, toks in rows:
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            row_slots=[r[0] for r in rows],
            row_starts=[r[1] for r in rows],
            row_lens=[len(r[2]) for r in rows],
            row_decode=tuple(decode),
        )


WEIGHT_FORMATS = ("dense", "int8", "int4")
_HEAD_FORMAT = {"dense": "dense", "int8": "int8", "int4": "dense"}  # the head: GGUF keeps it in 8 bits or more (Q8_0, Q6_K)

_Weight = Union[torch.Tensor, BF16Linear, Int8Weight, Int4Weight]  # plain [out, in], packed, or int


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: _Weight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: Optional[torch.Tensor]  # [q_size + 2 * kv_size]
    qk_norm: Optional[torch.Tensor]  # [heads + kv_heads, head_dim]: q_norm rows then k_norm rows
    o: _Weight  # [hidden, q_size]
    o_bias: Optional[torch.Tensor]  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: _Weight  # [2 * intermediate, hidden]
    down: _Weight  # [hidden, intermediate]


class Decoder:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, batch_invariant: Optional[bool] = None, weights: str = "dense",
                 own_kernel: Optional[bool] = None, own_attention: Optional[bool] = None,
                 own_layers: Optional[bool] = None):
        if weights not in WEIGHT_FORMATS:
            raise ModelError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
        if weights != "dense" and not (dtype == torch.bfloat16 and _packs_linears(torch.device(device), dtype)):
            raise ModelError(f"weights {weights} needs bfloat16 on a CPU with oneDNN")
        self.weights = weights
        self.config = config
        self.batch_invariant = (torch.device(device).type == "cpu") if batch_invariant is None else batch_invariant
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        take = _Taker(tensors, dtype, self.device)
        self.embed: Optional[torch.Tensor] = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.lm_head = (self.embed if c.tie_word_embeddings
                        else take("lm_head.weight", (c.vocab_size, c.hidden_size)))
        self.norm = take("model.norm.weight", (c.hidden_size,))
        qkv_rows = c.q_size + 2 * c.kv_size
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = fuse([take(a + "q_proj.weight", (c.q_size, c.hidden_size)),
                             take(a + "k_proj.weight", (c.kv_size, c.hidden_size)),
                             take(a + "v_proj.weight", (c.kv_size, c.hidden_size))])
            qkv_bias = None
            if c.attention_bias:
                qkv_bias = fuse([take(a + "q_proj.bias", (c.q_size,)),
                                      take(a + "k_proj.bias", (c.kv_size,)),
                                      take(a + "v_proj.bias", (c.kv_size,))])
            qk_norm = None
            if c.qk_norm:
                qk_norm = torch.cat([take(a + "q_norm.weight", (c.head_dim,)).expand(c.num_heads, -1),
                                     take(a + "k_norm.weight", (c.head_dim,)).expand(c.num_kv_heads, -1)])
            o_bias = take.optional(a + "o_proj.bias", (c.hidden_size,))
            m = p + "mlp."
            gate_up = fuse([take(m + "gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                                 take(m + "up_proj.weight", (c.intermediate_size, c.hidden_size))])
            self.layers.append(_Layer(
                input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
                qkv=qkv.reshape(qkv_rows, c.hidden_size),
                qkv_bias=qkv_bias,
                qk_norm=qk_norm,
                o=take(a + "o_proj.weight", (c.hidden_size, c.q_size)),
                o_bias=o_bias,
                post_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
                gate_up=gate_up,
                down=take(m + "down_proj.weight", (c.hidden_size, c.intermediate_size)),
            ))
        take.finish()
        self._rope: Optional[RopeTable] = None
        self._min_rows = _MIN_ROWS.get(dtype, 1)
        self._packed = _packs_linears(self.device, dtype)
        # bfloat16 dense linears on mashbox's kernel (model/linear.py) where the CPU runs
        # it: batch invariant for any rows, so no padding rows (_min_rows 1)
        # (with int8 / int4 weights only the output head is dense; the int kernels keep
        # their padding rows)
        self.own_kernel = (self._packed and dtype == torch.bfloat16
                           and bf16_kernel_available() and own_kernel is not False)
        if self.own_kernel and weights == "dense":
            self._min_rows = 1
        if self._packed:
            self._pack_weights(weights)
        # decode rows (Batch.row_decode) attend on csrc's kernel (model/attention.py) where
        # it runs; own_attention=False keeps SDPA for them (a side-by-side)
        self.own_attention = attention.supported(config, dtype, self.device) and own_attention is not False
        # a step of decode rows only runs its layers in one csrc call (csrc/layers.c) where
        # every piece of a layer runs in csrc; own_layers=False keeps the calls in Python
        self._c_layers = self._layers_for_c() if own_layers is not False else None

    def _pack_weights(self, weights: str) -> None:
        """Reorder every linear weight into oneDNN's blocked layout, once. Measured on this
        project's CPU (default model, batch-1 decode, 1 thread): bf16 matmuls take 10 ms
        instead of 19 ms per step, each output bit-identical to F.linear's; float32
        steps 23 ms instead of 37 (there F.linear takes MKL, whose bits differ). A tied
        output head gets its own packed copy; on oneDNN the embedding keeps the plain
        layout for its row gather (the embedding's bytes once more in memory), on the own
        kernel it gathers from the packed head and the plain copy is freed.

        weights (opt-in "int8" / "int4"): weight-only int8 per row or int4 per
        group of 32 instead (other logits than dense, still batch invariant); a weight
        whose input size the int4 groups do not divide stays dense.

        own_kernel: BF16Linear instead of oneDNN (biases folded into it). Measured on
        this project's CPU, 2 threads, default model: a [1, 576] x [576, 960] product
        7 us against 19, batch-1 decode 1.3x faster, prefill the same, worker RSS 91 MB
        less (554 against 645 MB)."""
        arena = None
        if self.own_kernel and weights == "dense":
            # every packed weight in one buffer, in the order a step reads them
            order = [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            order.append(self.lm_head)
            arena = linear.WeightArena(linear.arena_bytes(
                [BF16Linear.packed_bytes(w) for w in order if BF16Linear.supports(w)]))

        def pack(w: torch.Tensor, fmt: str, bias: Optional[torch.Tensor] = None) -> _Weight:
            if fmt == "int4" and w.shape[1] % INT4_GROUP == 0 and w.shape[0] % 8 == 0:
                return Int4Weight.of(w)
            if fmt == "int8":
                return Int8Weight.of(w)
            if self.own_kernel and BF16Linear.supports(w):
                into = None if arena is None else arena.take(BF16Linear.packed_bytes(w))
                return BF16Linear(w, bias, into=into)
            return torch.ops.mkldnn._reorder_linear_weight(w, 2)
        for layer in self.layers:
            layer.qkv = pack(layer.qkv, weights, layer.qkv_bias)
            layer.o = pack(layer.o, weights, layer.o_bias)
            if isinstance(layer.qkv, BF16Linear):
                layer.qkv_bias = None
            if isinstance(layer.o, BF16Linear):
                layer.o_bias = None
            layer.gate_up, layer.down = pack(layer.gate_up, weights), pack(layer.down, weights)
        self.lm_head = pack(self.lm_head, _HEAD_FORMAT[weights])
        if self.config.tie_word_embeddings and isinstance(self.lm_head, BF16Linear):
            # the embedding's rows come out of the packed head (BF16Linear.rows): the
            # plain copy is freed (the default model: 56 MB)
            self.embed = None

    def _layers_for_c(self):
        """native.bf16_layers of every layer when all of a decode step's layers can run in
        csrc (own kernel, dense weights, own attention, no q/k norm), else None."""
        if not (self.own_kernel and self.own_attention and self.weights == "dense"):
            return None
        entries = []
        for layer in self.layers:
            ws = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if layer.qk_norm is not None or not all(isinstance(w, BF16Linear) for w in ws):
                return None
            layer.input_norm, layer.post_norm = layer.input_norm.contiguous(), layer.post_norm.contiguous()
            entries.append(dict(
                input_norm=layer.input_norm.data_ptr(), post_norm=layer.post_norm.data_ptr(),
                qkv=layer.qkv.packed.data_ptr(), o=layer.o.packed.data_ptr(),
                gate_up=layer.gate_up.packed.data_ptr(), down=layer.down.packed.data_ptr(),
                qkv_bias=0 if layer.qkv.bias is None else layer.qkv.bias.data_ptr(),
                o_bias=0 if layer.o.bias is None else layer.o.bias.data_ptr()))
        return native.bf16_layers(entries)

    def _layers_in_c(self, x: torch.Tensor, positions: torch.Tensor, plan: "_Plan", cache: KVCache,
                     rope: RopeTable) -> None:
        """Every layer of a step whose rows all decode on csrc's attention, in one csrc call
        (csrc/layers.c): the calls forward's own-kernel path makes from Python, in the same
        order, so the same bits; x [T, hidden] is updated in place."""
        c, own = self.config, plan.own
        T = int(x.shape[0])
        scratch = torch.empty(native.bf16_decode_scratch(T, c.hidden_size, c.num_heads, c.num_kv_heads,
                                                         c.head_dim, c.intermediate_size), dtype=torch.bfloat16)
        positions = positions.contiguous()
        native.bf16_decode_layers_ptr(
            self._c_layers, len(self.layers), c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.rms_norm_eps, x.data_ptr(), T, positions.data_ptr(), own.rows.data_ptr(),
            own.slots.data_ptr(), own.ends.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr(),
            int(rope.cos.shape[0]), cache.k.data_ptr(), cache.v.data_ptr(), cache.k.stride(0), cache.slots,
            cache.capacity, own.window, own.scale, scratch.data_ptr(), scratch.numel(), self.layers[0].qkv.kernel,
            linear.parallel(), torch.get_num_threads())

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] rows of the embedding."""
        if self.embed is None:
            return self.lm_head.rows(ids)
        return F.embedding(ids, self.embed)

    def _linear(self, x: torch.Tensor, w: _Weight, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [M, in] @ w.T (+ b) -> [M, out]; w plain, packed or quantized by _pack_weights."""
        if isinstance(w, BF16Linear):
            return w(x)  # its bias is folded in
        if isinstance(w, (Int8Weight, Int4Weight)):
            y = w(x)
            return y if b is None else y + b
        if self._packed:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")
        return F.linear(x, w, b)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMS norm over the last dim of x [M, hidden]: csrc's on the own kernel's path."""
        if self.own_kernel:
            return linear.rms_norm(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[M, 2 intermediate] ([gate | up]) -> [M, intermediate] silu(gate) * up: csrc's on
        the own kernel's path (rounded once)."""
        if self.own_kernel:
            return linear.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _residual(self, x: torch.Tensor, inp: torch.Tensor, w: _Weight,
                  b: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x + inp @ w.T (+ b); x [M, hidden] is updated in place on the own kernel
        (one rounding, no new tensor), so it must be the forward's own."""
        if isinstance(w, BF16Linear):
            w.add_into(inp, x)
            return x
        return x + self._linear(inp, w, b)

    def _rope_table(self, length: int) -> RopeTable:
        if self._rope is None or self._rope.length < length:
            self._rope = RopeTable(self.config, length, self.dtype, self.device)
        return self._rope

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: KVCache) -> torch.Tensor:
        """Run the batch, write its K/V into `cache`; float32 logits [rows, vocab]."""
        c = self.config
        T = batch.input_ids.shape[0]
        plan = _Plan(batch, cache, c, self.dtype, self.device, invariant=self.batch_invariant,
                     own_decode=self.own_attention)
        ids, positions = batch.input_ids, batch.positions
        # Batch invariance: float32 linears round differently below _min_rows rows (see
        # the module docstring), so a short step runs on padding rows too; their
        # K/V are never written and their outputs never read.
        Tp = max(T, self._min_rows) if self.batch_invariant else T
        if Tp > T:
            ids = F.pad(ids, (0, Tp - T))
            positions = F.pad(positions, (0, Tp - T))
        rope = self._rope_table(cache.ctx)
        if not self.own_kernel:  # the own kernel's rope_kv reads the table rows itself
            cos = rope.cos[positions].unsqueeze(1)  # [Tp, 1, head_dim]
            sin = rope.sin[positions].unsqueeze(1)  # [Tp, 1, head_dim]
        H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        x = self._embed(ids)  # [Tp, hidden]
        in_c = self._c_layers is not None and plan.own is not None and plan.own.count == T == Tp
        if in_c:
            self._layers_in_c(x, batch.positions, plan, cache, rope)
        else:
            attn = torch.zeros(Tp, c.q_size, dtype=self.dtype, device=self.device)  # [Tp, heads * head_dim]
        for li, layer in enumerate(() if in_c else self.layers):
            h = self._norm(x, layer.input_norm, eps)
            qkv = self._linear(h, layer.qkv, layer.qkv_bias)  # [Tp, (heads + 2 kv_heads) * head_dim]
            qk = qkv[:, : c.q_size + c.kv_size].view(Tp, H + KV, D)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, (D,), None, eps) * layer.qk_norm
            k_cache = cache.k[li]  # [slots, kv_heads, capacity, head_dim]
            v_cache = cache.v[li]
            if self.own_kernel:  # rope in float32, rounded once; K/V written by the same call
                if layer.qk_norm is not None:
                    qkv[:, : c.q_size + c.kv_size] = qk.reshape(Tp, -1)
                linear.rope_kv(qkv, T, H, KV, rope.cos, rope.sin, batch.positions, plan.token_slots,
                               k_cache, v_cache)
                q = qkv[:T, : c.q_size].view(T, H, D)  # [T, heads, head_dim]
            else:
                qk = rope.apply(qk, cos, sin)  # [Tp, heads + kv_heads, head_dim]
                q = qk[:T, :H]  # [T, heads, head_dim]
                k_cache[plan.token_slots, :, batch.positions] = qk[:T, H:]
                v_cache[plan.token_slots, :, batch.positions] = qkv[:T, c.q_size + c.kv_size:].view(T, KV, D)
            plan.attend(q, k_cache, v_cache, attn)
            x = self._residual(x, attn, layer.o, layer.o_bias)
            h = self._norm(x, layer.post_norm, eps)
            x = self._residual(x, self._act(self._linear(h, layer.gate_up)), layer.down)
        last = x[plan.last_tokens]  # [rows, hidden]
        rows = last.shape[0]
        if self.batch_invariant and rows < self._min_rows:
            last = F.pad(last, (0, 0, 0, self._min_rows - rows))
        last = self._norm(last, self.norm, eps)
        if isinstance(self.lm_head, BF16Linear):
            return self.lm_head(last, torch.float32)[:rows]  # [rows, vocab], one rounding fewer
        return self._linear(last, self.lm_head)[:rows].float()  # [rows, vocab]

    __call__ = forward


# Batch invariance (see the module docstring), measured on this project's CPU
# (AMD EPYC with avx512_bf16, torch 2.13, oneDNN / MKL), 1 and 2 threads:
# - oneDNN linears on packed weights (bfloat16 and float32) give the same bits per row
#   for any 2 or more rows, other bits for 1 row (the MLP down projection). (Plain
#   float32 F.linear takes MKL: other bits for 1-3 rows and, with 2 threads, 5-7.)
# - SDPA's flash kernel on CPU splits keys into blocks of 512; inside a block its gemms
#   round differently for other block widths (float32: a query at position 300 gets
#   other bits over 384 keys than over 320; bfloat16 the same, seen less often after
#   rounding). Keys past a query's own are masked (probability exactly 0), and a wholly
#   masked block adds exact zeros. So a row reads its slot's keys [0, key_width(end)):
#   128 while it fits (the same bits as 512 for those queries, measured), else whole
#   blocks of 512, and each query meets the same block widths whatever its row.
# - Inside that kernel the q.k and p.v gemms give other bits for query blocks of fewer
#   than 4 rows (both dtypes). Query blocks are 32, 64, 128 or 256 rows, so
#   _padded_queries keeps every block at 4 rows or more.
_MIN_ROWS = {torch.float32: 2, torch.bfloat16: 2}
_QUERY_MULTIPLE = {torch.float32: 4, torch.bfloat16: 4}


def _packs_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU with oneDNN: linears run on prepacked weights (Decoder._pack_weights)."""
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _padded_queries(n: int, group: int, multiple: int) -> int:
    """Queries of a row after padding, so that SDPA's query blocks (32, 64, 128 or 256 rows
    of group * queries) all hold at least `multiple` rows: group * padded is at least
    `multiple`, and past one block of 32 a multiple of it."""
    padded = max(n, -(-multiple // group))
    if group * padded > 32:
        while (group * padded) % multiple:
            padded += 1
    return padded


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
    queries: torch.Tensor  # [span, kv_heads, group, padded, head_dim], made once per forward
    mask: torch.Tensor  # [span, 1, group * padded, keys] additive


class _Plan:
    """One forward's attention plan: index tensors and masks shared by every layer.

    invariant: every row (prefill chunk or decode) takes one code path: masked SDPA over
    the slot's keys [0, key_width(end)), its queries padded to the dtype's
    multiple, so a query's result depends only on its own keys and position. Otherwise
    plain causal prefills, and decode rows over compact slot ranges batched in one call.
    """

    def __init__(self, batch: Batch, cache: KVCache, c: ModelConfig, dtype: torch.dtype,
                 device: torch.device, invariant: bool, own_decode: bool = False):
        self.dtype = dtype
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
            elif invariant and n == 1:
                invariant_decodes.append((t0, slot, end))
            elif invariant:
                keys = key_width(end)
                padded = _padded_queries(n, self.group, qmult)
                # padding queries repeat the last one's position (their output is dropped)
                qpos = torch.arange(start, start + padded, device=device).clamp_(max=end - 1).unsqueeze(1)
                kpos = torch.arange(0, keys, device=device).unsqueeze(0)  # [1, keys]
                allowed = kpos <= qpos  # [padded, keys]
                if window is not None:
                    allowed &= kpos > qpos - window
                mask = self._additive(allowed).expand(self.group, padded, keys)  # query row (g, i): position i
                self.rows.append((t0, n, padded, slot, keys, mask.reshape(1, 1, self.group * padded, keys)))
            elif n == 1:
                decodes.append((t0, slot, end))
            else:
                lo = 0 if window is None else max(0, start + 1 - window)
                mask = None
                if start > 0 or lo > 0:
                    qpos = torch.arange(start, end, device=device).unsqueeze(1)  # [n, 1]
                    kpos = torch.arange(lo, end, device=device).unsqueeze(0)  # [1, L]
                    mask = kpos <= qpos  # [n, L]
                    if window is not None:
                        mask &= kpos > qpos - window
                elif window is not None and n > window:
                    qpos = torch.arange(0, n, device=device).unsqueeze(1)
                    kpos = torch.arange(0, n, device=device).unsqueeze(0)
                    mask = (kpos <= qpos) & (kpos > qpos - window)
                self.prefills.append((t0, n, slot, lo, end, None if mask is None else self._additive(mask)))
            t0 += n
        self.token_slots = torch.tensor(token_slots, dtype=torch.int64, device=device)  # [T]
        self.last_tokens = torch.tensor(last, dtype=torch.int64, device=device)  # [rows]
        self.decodes = decodes
        self.own = attention.DecodeRows(own, c) if own else None
        self.batched = None
        self.groups: list[_DecodeGroup] = []
        if invariant_decodes:
            self._group_decodes(invariant_decodes, window, _padded_queries(1, self.group, qmult), device)
        if not invariant:
            self._plan_decodes(decodes, window, device)

    def _group_decodes(self, decodes: list[tuple[int, int, int]], window: Optional[int], padded: int,
                       device: torch.device) -> None:
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
            kpos = torch.arange(keys).unsqueeze(0)  # [1, keys]
            qpos = torch.tensor([end - 1 for _, _, end in rows]).unsqueeze(1)  # [rows, 1]
            real = kpos <= qpos  # [rows, keys]
            if window is not None:
                real &= kpos > qpos - window
            allowed = (kpos == 0).expand(span, keys).clone()  # a spare slot in the range: key 0 only
            allowed[index] = real  # [span, keys]
            # [span, 1, group * padded, keys]: every query of a slot at its row's position
            mask = self._additive(allowed.to(device)).view(span, 1, 1, keys).expand(
                span, 1, G * padded, keys).contiguous()
            tokens = [r[0] for r in rows]
            # the common case: the step's tokens 0..rows-1 fill slots lo..hi in order, so
            # queries and outputs move by views instead of index ops
            dense = tokens == index == list(range(len(rows)))
            self.groups.append(_DecodeGroup(
                keys=keys, lo=lo, hi=hi, dense=dense,
                gather=None if compact else torch.tensor(slots, device=device),
                tokens=torch.tensor(tokens, device=device),  # [rows]
                index=torch.tensor(index, device=device),  # [rows] each row's place in the call
                queries=torch.zeros(span, KV, G, padded, D, dtype=self.dtype, device=device),
                mask=mask))

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """Bool mask -> 0 / -inf in the model dtype, made once per forward: SDPA on CPU
        converts a bool mask on every call, which costs more than the attention itself
        for short decode rows."""
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill_(
            ~allowed, float("-inf"))

    def _plan_decodes(self, decodes: list[tuple[int, int, int]], window: Optional[int],
                      device: torch.device) -> None:
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
        # [span, 1, 1, kv_len - kv_lo] True where a slot's row may attend; slots in the
        # range without a row attend to key 0 only (their output is dropped).
        kpos = torch.arange(kv_lo, kv_len, device=device)
        limit = torch.full((span,), 1 + kv_lo, dtype=torch.int64)
        start = torch.full((span,), kv_lo, dtype=torch.int64)
        for _, slot, length in decodes:
            limit[slot - lo_slot] = length
            if window is not None:
                start[slot - lo_slot] = max(0, length - window)
        limit, start = limit.to(device), start.to(device)
        mask = (kpos < limit.unsqueeze(1)) & (kpos >= start.unsqueeze(1))
        token_index = torch.full((span,), -1, dtype=torch.int64)
        for t, slot, _ in decodes:
            token_index[slot - lo_slot] = t
        present = token_index >= 0
        self.batched = (
            lo_slot, hi_slot, kv_lo, kv_len,
            self._additive(mask).view(span, 1, 1, kv_len - kv_lo),
            token_index.clamp(min=0).to(device),  # [span] the token of each slot in range
            torch.nonzero(present).flatten().to(device),  # [decodes] range index of each row
            token_index[present].to(device),  # [decodes] their tokens
        )

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        """q [T, heads, head_dim]; caches [slots, kv_heads, ctx, head_dim]; out [T, heads*head_dim]."""
        KV, G, D = self.kv_heads, self.group, self.head_dim
        if self.own is not None:
            self.own.attend(q, k_cache, v_cache, out)
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


class _Taker:
    """Pops named tensors out of the loader's dict, checking shapes and casting."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.tensors = tensors
        self.dtype = dtype
        self.device = device

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise ModelError(f"weights lack tensor {name}")
        return self._check(name, self.tensors.pop(name), shape)

    def optional(self, name: str, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
        if name not in self.tensors:
            return None
        return self._check(name, self.tensors.pop(name), shape)

    def _check(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != tuple(shape):
            raise ModelError(f"tensor {name} has shape {tuple(t.shape)}, the config implies {tuple(shape)}")
        return t.to(device=self.device, dtype=self.dtype)

    def finish(self) -> None:
        if self.tensors:
            names = sorted(self.tensors)
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            raise ModelError(f"weights have tensors the decoder does not use: {', '.join(names[:5])}{more}")

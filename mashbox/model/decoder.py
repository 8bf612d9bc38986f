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
- Kernels are chosen once, at construction (model/kernels.py): the form of every linear
  weight (model/linear.py: csrc's bfloat16 kernel where the CPU has AVX512-BF16, else
  oneDNN-packed, else plain; weights="int8" / "int4" opts into weight-only quantized
  linears), the row ops that go with them (model/row_ops.py), the decode rows'
  attention (model/attention.py) and the layer loop (model/layer_loop.py: a step of
  decode rows only runs every layer in one csrc call). forward() asks none of these
  again. float32 keeps torch's ops, which the transformers parity tests compare.
- Attention is planned once per forward (model/attention_plan.py) and run by every layer.
- GQA never materialises repeated K/V: a row's q is viewed as [kv_heads, group * n,
  head_dim] against the slot's [kv_heads, L, head_dim] keys (batch_invariant), or prefill
  uses SDPA's enable_gqa.
- Batch invariance: with batch_invariant (the default on CPU) a token's logits do not
  depend on how its request was scheduled: whole or chunked prefill, its last prompt
  token recomputed alone after a prefix-cache hit, alone or beside other rows, in
  bfloat16 and float32 (bit-identical; measured on this project's CPU, see _MIN_ROWS).
  Decode rows and prompt rows on csrc's attention (decode and prefill kernels) depend on
  their own query, keys and position only. On SDPA three rules make it so: every row, prefill chunk or decode, attends through one masked
  SDPA call over its slot's keys [0, kv_cache.key_width(end)): 128, or whole blocks of
  512 (masked keys add exact zeros); its queries are padded so SDPA's gemms never see
  fewer rows than the dtype's small-M threshold; and linears run on at least _MIN_ROWS
  rows (padding rows otherwise; csrc's kernel needs none: its rows never meet). The
  decode and prefill kernels (or SDPA) keep different arithmetic, so a generated token's
  K/V can differ in its last bits from the same token's computed as part of a later
  prompt that misses the prefix cache; a hit reuses the generated token's own K/V. A sliding-window
  model reads keys from 0 too (masked outside its window). What invariance costs is
  measured by benchmarks/decode.py (README, speed).
  Without batch_invariant (the default on CUDA, where kernel launches dominate) decode
  rows whose slots cover a compact range attend in one SDPA call over a view of that
  range, padded keys masked, and prefill chunks use plain causal attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from mashbox.model import attention
from mashbox.model import device as device_mod
from mashbox.model.attention_plan import AttentionPlan, MaskArena
from mashbox.model.block_weight import BlockWeight
from mashbox import native
from mashbox.model.errors import ModelError
from mashbox.model.fused_layout import fuse
from mashbox.model.kernels import Kernels
from mashbox.model.kv_cache import KVCache
from mashbox.model import linear
from mashbox.model.layer_loop import CLayers, Layer, PythonLayers, Step, StepLimits
from mashbox.model.linear import (INT4_GROUP, BF16Linear, Int4Weight, Int8Weight, Linear, OneDNNLinear,
                                  QkvSplit, QuantLinear, TorchLinear)
from mashbox.model.model_config import ModelConfig
from mashbox.model.rope import RopeTable
from mashbox.model.row_ops import CsrcRowOps, TorchRowOps


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


WEIGHT_FORMATS = ("dense", "int8", "int4", "gguf")
_HEAD_FORMAT = {"dense": "dense", "int8": "int8", "int4": "dense", "gguf": "gguf"}  # the head: GGUF keeps it in 8 bits or more (Q8_0, Q6_K)


@dataclass(slots=True)
class _Parts:
    """One layer's weights as loaded, before they take their linear form."""
    input_norm: torch.Tensor  # [hidden]
    qkv: Union[torch.Tensor, BlockWeight, tuple[BlockWeight, BlockWeight]]  # [q_size + 2 * kv_size, hidden]; (q|k, v) blocks of two types
    qkv_bias: Optional[torch.Tensor]  # [q_size + 2 * kv_size]
    qk_norm: Optional[torch.Tensor]  # [heads + kv_heads, head_dim]
    o: torch.Tensor  # [hidden, q_size]
    o_bias: Optional[torch.Tensor]  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class Decoder:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, batch_invariant: Optional[bool] = None, weights: str = "dense",
                 kernels: Kernels = Kernels(), limits: StepLimits = StepLimits()):
        """batch_invariant: None is the device's default (True on CPU); kernels: what to
        run on (model/kernels.py), resolved here once and kept as self.kernels; limits:
        the most rows a step can have (model/layer_loop.py), which sizes the layer loop's
        buffers once; a bigger step is a ValueError."""
        if weights not in WEIGHT_FORMATS:
            raise ModelError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
        self.device = torch.device(device)
        self._packed = _packs_linears(self.device, dtype)
        if weights != "dense" and not (dtype == torch.bfloat16 and self._packed):
            raise ModelError(f"weights {weights} needs bfloat16 on a CPU with oneDNN")
        if weights == "gguf" and not native.NATIVE:
            raise ModelError("weights gguf needs the C extension (mashbox._native), which is not built")
        self.weights = weights
        self.config = config
        self.batch_invariant = (self.device.type == "cpu") if batch_invariant is None else batch_invariant
        self.dtype = dtype
        self.kernels = kernels.resolve(config, dtype, self.device, weights, self._packed,
                                       amx=self.device.type == "cpu" and device_mod.amx_bf16())
        parts = self._take(config, tensors)
        # csrc's linears are batch invariant for any rows, so no padding rows (_min_rows 1)
        # (with int8 / int4 weights only the output head is dense; the int kernels keep
        # their padding rows)
        self._min_rows = _MIN_ROWS.get(dtype, 1)
        if self.kernels.linears == "csrc" and weights in ("dense", "gguf"):
            self._min_rows = 1
        self.layers = self._linears(parts, weights)
        self._rope: Optional[RopeTable] = None
        csrc_linears = self.kernels.linears == "csrc"
        self.ops = CsrcRowOps(config) if csrc_linears else TorchRowOps(config)
        self._attention_kernel = self.kernels.kernel if self.kernels.attention == "csrc" else 0
        # prompt rows take csrc's prefill kernel with the decode rows' where kernels.prefill says so
        self._prefill_kernel = self._attention_kernel if self.kernels.prefill == "csrc" else 0
        self._row_index = attention.RowIndex()  # the plans' index rows, made once
        self._masks = MaskArena(dtype, self.device)  # the SDPA path's masks, made once
        self.limits = limits
        padded = max(limits.tokens, self._min_rows) if self.batch_invariant else limits.tokens
        python = PythonLayers(config, self.layers, self.ops, dtype, self.device, padded)
        self.loop = (CLayers(config, self.layers, python, self.kernels.kernel, min(limits.decode_rows, limits.tokens))
                     if self.kernels.layers == "c" else python)
        self._logits = self._logits_f32 if isinstance(self.lm_head, (BF16Linear, QuantLinear)) else self._logits_cast

    def _take(self, c: ModelConfig, tensors: dict[str, torch.Tensor]) -> list[_Parts]:
        take = _Taker(tensors, self.dtype, self.device)
        self.embed: Union[torch.Tensor, BlockWeight, None] = take("model.embed_tokens.weight",
                                                                  (c.vocab_size, c.hidden_size))
        self._head = (self.embed if c.tie_word_embeddings
                      else take("lm_head.weight", (c.vocab_size, c.hidden_size)))
        if isinstance(self.embed, BlockWeight) and not c.tie_word_embeddings:
            # its rows are dequantized on lookup (a gather of T rows a step); a copy of its
            # blocks, so the file mapping is not kept alive for it
            self.embed = BlockWeight(self.embed.type_name, self.embed.raw.clone(), self.embed.shape)
        self.norm = take("model.norm.weight", (c.hidden_size,))
        qkv_rows = c.q_size + 2 * c.kv_size
        parts: list[_Parts] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = self._fuse([take(a + "q_proj.weight", (c.q_size, c.hidden_size)),
                              take(a + "k_proj.weight", (c.kv_size, c.hidden_size)),
                              take(a + "v_proj.weight", (c.kv_size, c.hidden_size))], split_last=True)
            qkv_bias = None
            if c.attention_bias:
                qkv_bias = fuse([take(a + "q_proj.bias", (c.q_size,)),
                                 take(a + "k_proj.bias", (c.kv_size,)),
                                 take(a + "v_proj.bias", (c.kv_size,))])
            qk_norm = None
            if c.qk_norm:
                qk_norm = torch.cat([take(a + "q_norm.weight", (c.head_dim,)).expand(c.num_heads, -1),
                                     take(a + "k_norm.weight", (c.head_dim,)).expand(c.num_kv_heads, -1)])
            m = p + "mlp."
            gate_up = self._fuse([take(m + "gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                                  take(m + "up_proj.weight", (c.intermediate_size, c.hidden_size))])
            parts.append(_Parts(
                input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
                qkv=qkv if isinstance(qkv, (BlockWeight, tuple)) else qkv.reshape(qkv_rows, c.hidden_size),
                qkv_bias=qkv_bias, qk_norm=qk_norm,
                o=take(a + "o_proj.weight", (c.hidden_size, c.q_size)),
                o_bias=take.optional(a + "o_proj.bias", (c.hidden_size,)),
                post_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
                gate_up=gate_up, down=take(m + "down_proj.weight", (c.hidden_size, c.intermediate_size))))
        take.finish()
        return parts

    def _fuse(self, parts: list, split_last: bool = False) -> Union[torch.Tensor, BlockWeight, tuple]:
        """Parts of a fused weight: their blocks stacked where all are blocks of one type
        (weights "gguf"); with split_last, blocks whose last part alone has another type
        (q|k|v with v in Q6_K beside Q4_K q and k, as Q4_K_M files hold it) stay blocks as
        (the others stacked, the last): linear.QkvSplit; else dense (a part in blocks
        dequantized: another type beside it)."""
        if all(isinstance(p, BlockWeight) for p in parts):
            types = {p.type_name for p in parts}
            if len(types) == 1:
                return BlockWeight.cat(parts)
            if split_last and len({p.type_name for p in parts[:-1]}) == 1:
                return BlockWeight.cat(parts[:-1]), parts[-1]
        return fuse([p.dequantize(self.dtype, self.device) if isinstance(p, BlockWeight) else p for p in parts])

    def _linears(self, parts: list[_Parts], weights: str) -> list[Layer]:
        """Every linear weight in the form self.kernels says, made once (model/linear.py).

        csrc's linears: every packed weight in one WeightArena, in the order a step reads
        them, biases folded in; a tied head gets its own packed copy and the embedding
        gathers its rows from it, so the plain copy is freed. oneDNN: the weights
        reordered into its blocked layout (each output bit-identical to F.linear's in
        bfloat16; float32 F.linear would take MKL, whose bits differ); a tied head gets a
        packed copy, the embedding keeps the plain layout for its row gather.

        weights "gguf": a weight still in the file's blocks (BlockWeight) becomes a
        QuantLinear, its blocks copied into the same arena; the others (dense types, or
        block types csrc does not read yet) stay BF16Linear.

        weights (opt-in "int8" / "int4"): weight-only int8 per row or int4 per group of 32
        instead (other logits than dense, still batch invariant); a weight whose input
        size the int4 groups do not divide stays dense."""
        kind, kernel = self.kernels.linears, self.kernels.kernel
        rule = self.kernels.prompt_linears  # the prompt rows' rule (QuantLinear)
        arena = None
        if kind == "csrc" and weights in ("dense", "gguf"):
            order = [w for p in parts for w in (*_split(p.qkv), p.o, p.gate_up, p.down)] + [self._head]
            arena = linear.WeightArena(linear.arena_bytes(
                [w.nbytes if isinstance(w, BlockWeight) else BF16Linear.packed_bytes(w)
                 for w in order if isinstance(w, BlockWeight) or BF16Linear.supports(w)]))

        def make(w: Union[torch.Tensor, BlockWeight, tuple], fmt: str, bias: Optional[torch.Tensor] = None) -> Linear:
            if isinstance(w, tuple):  # q|k and v blocks of two types
                qk, v = w
                into = None if arena is None else (arena.take(qk.nbytes), arena.take(v.nbytes))
                return QkvSplit(qk, v, bias, kernel=kernel or None, into=into, prompt_rule=rule)
            if isinstance(w, BlockWeight):
                into = None if arena is None else arena.take(w.nbytes)
                return QuantLinear(w, bias, kernel=kernel or None, into=into, prompt_rule=rule)
            if fmt == "int4" and w.shape[1] % INT4_GROUP == 0 and w.shape[0] % 8 == 0:
                return Int4Weight.of(w, bias)
            if fmt == "int8":
                return Int8Weight.of(w, bias)
            if kind == "csrc" and BF16Linear.supports(w):
                into = None if arena is None else arena.take(BF16Linear.packed_bytes(w))
                return BF16Linear(w, bias, kernel=kernel, into=into)
            if kind == "torch" or not self._packed:
                return TorchLinear(w, bias)
            return OneDNNLinear(w, bias)

        layers = []
        parts.reverse()
        while parts:  # in step order; each layer's plain weights freed once it is made
            p = parts.pop()
            layers.append(Layer(input_norm=p.input_norm, qkv=make(p.qkv, weights, p.qkv_bias), qk_norm=p.qk_norm,
                                o=make(p.o, weights, p.o_bias), post_norm=p.post_norm,
                                gate_up=make(p.gate_up, weights), down=make(p.down, weights)))
        del p
        self.lm_head: Linear = make(self._head, _HEAD_FORMAT[weights])
        del self._head
        if self.config.tie_word_embeddings and isinstance(self.lm_head, (BF16Linear, QuantLinear)):
            # the embedding's rows come out of the packed head (BF16Linear.rows): the
            # plain copy is freed (the default model: 56 MB)
            self.embed = None
        return layers

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] rows of the embedding."""
        if self.embed is None:
            return self.lm_head.rows(ids)
        if isinstance(self.embed, BlockWeight):
            return self.embed.rows(ids, self.dtype)
        return F.embedding(ids, self.embed)

    def _logits_f32(self, last: torch.Tensor, rows: int) -> torch.Tensor:
        return self.lm_head(last, torch.float32)[:rows]  # [rows, vocab], one rounding fewer

    def _logits_cast(self, last: torch.Tensor, rows: int) -> torch.Tensor:
        return self.lm_head(last)[:rows].float()  # [rows, vocab]

    def _rope_table(self, length: int) -> RopeTable:
        # Rebuilt for any other length, not only a longer one: dynamic NTK's frequencies
        # depend on the table's length (the slot's ctx), so a longer table is not a superset.
        if self._rope is None or self._rope.length != length:
            self._rope = RopeTable(self.config, length, self.dtype, self.device)
        return self._rope

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: KVCache) -> torch.Tensor:
        """Run the batch, write its K/V into `cache`; float32 logits [rows, vocab]."""
        T = batch.input_ids.shape[0]
        if T > self.limits.tokens:
            raise ValueError(f"a step of {T} tokens exceeds the decoder's limit of {self.limits.tokens} "
                             "(StepLimits.tokens, sized at start-up)")
        plan = AttentionPlan(batch, cache, self.config, self.dtype, self.device, invariant=self.batch_invariant,
                             decode_kernel=self._attention_kernel, prefill_kernel=self._prefill_kernel,
                             index=self._row_index, masks=self._masks)
        ids, positions = batch.input_ids, batch.positions
        # Batch invariance: float32 linears round differently below _min_rows rows (see
        # the module docstring), so a short step runs on padding rows too; their
        # K/V are never written and their outputs never read.
        Tp = max(T, self._min_rows) if self.batch_invariant else T
        if Tp > T:
            ids = F.pad(ids, (0, Tp - T))
            positions = F.pad(positions, (0, Tp - T))
        x = self._embed(ids)  # [Tp, hidden]
        prompt = _prompt_runs(batch) if self.kernels.prompt_linears != "same" else ()
        x = self.loop.run(x, Step(T, Tp, batch.positions, positions, plan, cache, self._rope_table(cache.ctx),
                                  prompt))
        last = x[plan.last_tokens]  # [rows, hidden]
        rows = last.shape[0]
        if self.batch_invariant and rows < self._min_rows:
            last = F.pad(last, (0, 0, 0, self._min_rows - rows))
        return self._logits(self.ops.norm(last, self.norm, self.config.rms_norm_eps), rows)

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
#   attention_plan.padded_queries keeps every block at 4 rows or more.
_MIN_ROWS = {torch.float32: 2, torch.bfloat16: 2}


def _prompt_runs(batch: Batch) -> tuple[tuple[int, int], ...]:
    """The [t0, t1) runs of the batch's prompt tokens (rows not flagged decode), adjacent
    rows merged: what the linears run by their prompt rule (model/linear.py)."""
    runs: list[tuple[int, int]] = []
    t0 = 0
    for i, n in enumerate(batch.row_lens):
        if not (batch.row_decode and batch.row_decode[i]):
            if runs and runs[-1][1] == t0:
                runs[-1] = (runs[-1][0], t0 + n)
            else:
                runs.append((t0, t0 + n))
        t0 += n
    return tuple(runs)


def _split(w) -> tuple:
    """A fused weight's parts as the arena holds them: (q|k, v) of a QkvSplit, else (w,)."""
    return w if isinstance(w, tuple) else (w,)


def _packs_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU with oneDNN: linears run on prepacked weights (Decoder._linears)."""
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


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

    def _check(self, name: str, t, shape: tuple[int, ...]):
        if tuple(t.shape) != tuple(shape):
            raise ModelError(f"tensor {name} has shape {tuple(t.shape)}, the config implies {tuple(shape)}")
        if isinstance(t, BlockWeight):  # kept in its blocks (weights "gguf")
            return t
        return t.to(device=self.device, dtype=self.dtype)

    def finish(self) -> None:
        if self.tensors:
            names = sorted(self.tensors)
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            raise ModelError(f"weights have tensors the decoder does not use: {', '.join(names[:5])}{more}")

"""The two ways a forward runs its decoder layers, chosen once (model/kernels.py, layers):

- PythonLayers: each layer's calls made from Python, in the order below; every step can
  take it.
- CLayers: a step whose rows all decode on csrc's attention runs every layer in one C
  call (csrc/layers.c: the same calls, in the same order, so the same bits: a Python
  call costs a few microseconds of its own, and a batch-1 decode step of the default
  model makes 300 of them); any other step goes to its PythonLayers.

Per layer, for x [Tp, hidden] (the residual stream, updated in place):
    h = norm(x); qkv = h @ qkv.T (+ bias); [q/k norm]; rope of q and k, K/V cache write;
    attention of every row over its slot; x += attn @ o.T (+ bias);
    h = norm(x); x += act(h @ gate_up.T) @ down.T
Each linear is told the step's prompt runs (Step.prompt), which a GGUF linear on AMX
tiles runs by its prompt rule (model/linear.py).

Buffers made once, at construction, for the most rows a step can have (StepLimits,
which the runner derives from its scheduler's token budget and its slots) and never
grown: the attention output [max rows, heads * head_dim] and C's scratch. A step with
more rows is refused (ValueError), not given a new buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from mashbox.model import csrc
from mashbox.model.attention_plan import AttentionPlan
from mashbox.model.kv_cache import KVCache
from mashbox.model.linear import BF16Linear, Linear, PromptRuns, QkvSplit, QuantLinear
from mashbox.model.model_config import ModelConfig
from mashbox.model.rope import RopeTable
from mashbox.model.row_ops import CsrcRowOps, TorchRowOps


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [q_size + 2 * kv_size, hidden], its bias folded in
    qk_norm: Optional[torch.Tensor]  # [heads + kv_heads, head_dim]: q_norm rows then k_norm rows
    o: Linear  # [hidden, q_size], its bias folded in
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The most rows one forward can be given, known at start-up so that the layer
    loop's buffers are made once. The runner: tokens = its step buffers' length
    (prefill_chunk + slots, what the scheduler can plan at most), decode_rows = its
    slots. The defaults are for decoders built outside a runner (tests, benchmarks)."""
    tokens: int = 2048  # T of any step (before padding rows)
    decode_rows: int = 64  # rows of a step whose rows all decode (CLayers' C scratch)

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.decode_rows < 1:
            raise ValueError(f"StepLimits needs tokens and decode_rows >= 1, got {self.tokens}, {self.decode_rows}")


@dataclass(slots=True)
class Step:
    """One forward's inputs to the layers."""
    tokens: int  # T: the batch's tokens
    padded: int  # Tp >= T: with padding rows (their K/V never written, outputs never read)
    positions: torch.Tensor  # [T] int64
    padded_positions: torch.Tensor  # [Tp] int64
    plan: AttentionPlan
    cache: KVCache
    rope: RopeTable
    # [t0, t1) runs of prompt rows (not decode rows) where the linears have a prompt rule
    # of their own (Kernels.prompt_linears "amx" or "lanes"); else () and every row takes one rule
    prompt: PromptRuns = ()


class PythonLayers:
    def __init__(self, config: ModelConfig, layers: list[Layer], ops: Union[CsrcRowOps, TorchRowOps],
                 dtype: torch.dtype, device: torch.device, max_rows: int) -> None:
        """max_rows: the most rows (padding rows included) a step can have."""
        self.config, self.layers, self.ops = config, layers, ops
        self.max_rows = max_rows
        self._attn = torch.zeros(max_rows, config.q_size, dtype=dtype, device=device)  # [max_rows, heads * head_dim]

    def _attention_out(self, tokens: int, padded: int) -> torch.Tensor:
        """[padded, heads * head_dim]: rows < tokens are written by every layer's attention
        before they are read; padding rows are zero, as a fresh buffer's."""
        if padded > self.max_rows:
            raise ValueError(f"a step of {padded} rows exceeds the layer loop's {self.max_rows} "
                             "(StepLimits.tokens, sized at start-up)")
        out = self._attn[:padded]
        if padded > tokens:
            out[tokens:].zero_()
        return out

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers made at construction (a test checks no step replaces one)."""
        return (self._attn,)

    def run(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        c, ops = self.config, self.ops
        T, Tp = step.tokens, step.padded
        H, KV, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        tables = ops.tables(step.rope, step.padded_positions)
        attn = self._attention_out(T, Tp)
        cache, plan, runs = step.cache, step.plan, step.prompt
        for li, layer in enumerate(self.layers):
            h = ops.norm(x, layer.input_norm, eps)
            qkv = layer.qkv(h, prompt=runs)  # [Tp, (heads + 2 kv_heads) * head_dim]
            qk = None
            if layer.qk_norm is not None:
                qk = qkv[:, : c.q_size + c.kv_size].view(Tp, H + KV, D)
                qk = F.rms_norm(qk, (D,), None, eps) * layer.qk_norm
            k_cache, v_cache = cache.k[li], cache.v[li]  # [slots, kv_heads, capacity, head_dim]
            q = ops.rope_kv(qkv, qk, T, tables, step.positions, plan.token_slots, k_cache, v_cache)
            plan.attend(q, k_cache, v_cache, attn)
            layer.o.add_into(attn, x, prompt=runs)
            h = ops.norm(x, layer.post_norm, eps)
            layer.down.add_into(ops.act(layer.gate_up(h, prompt=runs)), x, prompt=runs)
        return x


class CLayers:
    def __init__(self, config: ModelConfig, layers: list[Layer], python: PythonLayers, kernel: int,
                 max_rows: int) -> None:
        """max_rows: the most rows a step of decode rows only can have (StepLimits.decode_rows)."""
        c = config
        self.config, self.python, self.kernel = c, python, kernel
        entries = []
        for layer in layers:
            split = layer.qkv if isinstance(layer.qkv, QkvSplit) else None
            ws = (layer.qkv if split is None else split.qk, layer.o, layer.gate_up, layer.down)
            if layer.qk_norm is not None or not all(isinstance(w, (BF16Linear, QuantLinear)) for w in ws):
                raise ValueError("CLayers takes csrc linears (BF16Linear, QuantLinear, QkvSplit) and no q/k norms")
            layer.input_norm, layer.post_norm = layer.input_norm.contiguous(), layer.post_norm.contiguous()
            entry = dict(input_norm=layer.input_norm, post_norm=layer.post_norm, qkv_bias=layer.qkv.bias,
                         o_bias=layer.o.bias)
            if split is not None:  # q|k in qkv, v of its own type (mb_layer's v)
                entry["v"], entry["v_type"] = split.v.blocks, split.v.qtype
            for name, w in zip(("qkv", "o", "gate_up", "down"), ws):
                if isinstance(w, QuantLinear):  # GGUF blocks: mb_q_linear (csrc/quant.c)
                    entry[name], entry[name + "_type"] = w.blocks, w.qtype
                else:
                    entry[name] = w.packed
            entries.append(entry)
        self.table = csrc.LayerTable(entries, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                     c.intermediate_size)
        self.max_rows = max_rows
        # C's scratch for max_rows rows; a step of fewer rows uses its front (C's layout
        # is by rows: mb_bf16_decode_scratch grows with t)
        self._scratch = torch.empty(self.table.scratch_elements(max_rows), dtype=torch.bfloat16)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return (self._scratch,) + self.python.buffers()

    def run(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        own, T = step.plan.own, step.tokens
        if own is None or own.count != T or step.padded != T:
            return self.python.run(x, step)
        if T > self.max_rows:
            raise ValueError(f"a step of {T} decode rows exceeds the layer loop's {self.max_rows} "
                             "(StepLimits.decode_rows, sized at start-up)")
        rope, cache = step.rope, step.cache
        self.table.decode(x, step.positions.contiguous(), own.rows, own.slots, own.ends, self.config.rms_norm_eps,
                          rope.cos, rope.sin, cache.k, cache.v, own.window, own.scale, self._scratch, self.kernel)
        return x

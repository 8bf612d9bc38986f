"""FusedLayout: the weights the decoder keeps concatenated, and the buffers they load into.

The decoder multiplies by q|k|v as one matrix and by gate|up as one matrix. Rather than
load the parts and concatenate them afterwards (a second copy of those weights, and
twice the page faults), the loader asks `destination(name, shape)` for each tensor and
writes members of a fused weight straight into adjacent rows of one buffer. The loader
still returns HF-named tensors (views of those buffers); `fuse(parts)` in the decoder
then recognises adjacent views and takes the whole buffer without copying.
"""
from __future__ import annotations

from typing import Optional

import torch

from mashbox.model.model_config import ModelConfig


class FusedLayout:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.device = device
        # member name -> (buffer key, first row, rows, total rows, columns or 0 for a vector)
        self._members: dict[str, tuple[str, int, int, int, int]] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        c = config
        for i in range(c.num_layers):
            a = f"model.layers.{i}.self_attn."
            qkv = [("q_proj", c.q_size), ("k_proj", c.kv_size), ("v_proj", c.kv_size)]
            self._group(a + "qkv.weight", [(a + n + ".weight", r) for n, r in qkv], c.hidden_size)
            if c.attention_bias:
                self._group(a + "qkv.bias", [(a + n + ".bias", r) for n, r in qkv], 0)
            m = f"model.layers.{i}.mlp."
            self._group(m + "gate_up.weight", [(m + "gate_proj.weight", c.intermediate_size),
                                                (m + "up_proj.weight", c.intermediate_size)], c.hidden_size)

    def _group(self, key: str, members: list[tuple[str, int]], cols: int) -> None:
        total = sum(rows for _, rows in members)
        first = 0
        for name, rows in members:
            self._members[name] = (key, first, rows, total, cols)
            first += rows

    def destination(self, name: str, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
        """Where to load tensor `name` of `shape`: a view into its fused buffer, or None
        when it is not part of one (or its shape is not the config's: the decoder will
        report that)."""
        entry = self._members.get(name)
        if entry is None:
            return None
        key, first, rows, total, cols = entry
        if tuple(shape) != ((rows, cols) if cols else (rows,)):
            return None
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty((total, cols) if cols else (total,), dtype=self.dtype, device=self.device)
            self._buffers[key] = buf
        return buf[first:first + rows]


def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0; a view without a copy when the parts already sit side by
    side in one buffer (as the loader places them)."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    adjacent = all(p.is_contiguous() and p.untyped_storage().data_ptr() == storage
                   and p.dtype == first.dtype for p in parts)
    adjacent = adjacent and all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:]))
    if adjacent:
        rows = sum(p.shape[0] for p in parts)
        return first.as_strided((rows,) + tuple(first.shape[1:]), first.stride())
    return torch.cat(parts)

"""BlockWeight: a GGUF tensor kept in its file's quantized blocks, not dequantized.

Rules:
- raw is the tensor's bytes, uint8 [rows, row_bytes] (a view of the file mapping, or a
  copy where q/k rows were permuted); shape is the weight's [rows, k]. The decoder copies
  a linear's blocks once into its weight arena (model/linear.py's QuantLinear); nothing
  here is dequantized whole.
- Which block types stay blocks is one choice made at load: KERNEL_TYPES, the types
  csrc's mb_q_linear runs (the legacy Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 in csrc/quant.c,
  Q4_K / Q5_K / Q6_K in csrc/kquant.c). A tensor of another type is
  dequantized as before (gguf_weights.py), so such a file still loads.
- rows(ids) dequantizes only the rows asked for (an embedding lookup), with quants.py's
  decoders: the same bits as the whole tensor dequantized.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from mashbox import native
from mashbox.model import quants

# ggml type name -> ggml's type number (gguf.GGMLQuantizationType), the blocks csrc reads
GGML_TYPES = {"Q4_0": native.Q4_0, "Q4_1": native.Q4_1, "Q5_0": native.Q5_0, "Q5_1": native.Q5_1,
              "Q8_0": native.Q8_0, "Q4_K": native.Q4_K, "Q5_K": native.Q5_K, "Q6_K": native.Q6_K}


def _kernel_types() -> tuple[str, ...]:
    """The block types mb_q_linear takes in this build (native.q_supported asks C)."""
    if not native.NATIVE:
        return ()
    return tuple(name for name, number in GGML_TYPES.items() if native.q_supported(number))


KERNEL_TYPES = _kernel_types()


@dataclass(frozen=True)
class BlockWeight:
    type_name: str  # ggml's name, a key of GGML_TYPES
    raw: torch.Tensor  # uint8 [rows, row_bytes], CPU
    shape: tuple[int, int]  # [rows, k] of the weight it holds

    @property
    def qtype(self) -> int:
        return GGML_TYPES[self.type_name]

    @property
    def nbytes(self) -> int:
        return int(self.raw.numel())

    def dequantize(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The whole weight [rows, k] (the dense path, e.g. for a fused weight whose parts differ)."""
        return quants.dequantize(self.raw, self.type_name, self.shape[1], dtype, device)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids [T] (int64) dequantized: [T, k] of dtype."""
        return quants.dequantize(self.raw[ids], self.type_name, self.shape[1], dtype, self.raw.device)

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        """Parts of one type and k stacked along the rows (a fused q|k|v or gate|up)."""
        first = parts[0]
        return BlockWeight(first.type_name, torch.cat([p.raw for p in parts]),
                           (sum(p.shape[0] for p in parts), first.shape[1]))


def tensor_bytes(t: Union[torch.Tensor, BlockWeight]) -> int:
    """Bytes a loaded weight holds in memory."""
    return t.nbytes if isinstance(t, BlockWeight) else t.numel() * t.element_size()

"""Dequantization of GGML tensors into torch tensors of the target dtype.

Rules:
- Input is the raw bytes of one tensor as a uint8 tensor [rows, row_bytes] (a view of
  the memory-mapped file); output is [rows, row_elements] in the target dtype on the
  target device, allocated once. Rows are processed in chunks of about CHUNK_ELEMENTS so
  the float32 intermediates stay small whatever the tensor's size: the file's bytes and
  the final weights are the only large buffers alive at any time.
- On CUDA the raw bytes of a chunk are copied to the device and decoded there.
- Block layouts follow ggml (ggml-common.h); each decoder below says its layout. The
  parity test compares every one with gguf-py's numpy reference (gguf.quants).
"""
from __future__ import annotations

from typing import Callable

import torch

from mashbox.model.errors import ModelError

CHUNK_ELEMENTS = 1 << 21  # float32 intermediates of a chunk: a few times 8 MB


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2k] uint8 -> [n, k] float32, little-endian float16 values."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] uint8 -> [n, 32] float32: low nibbles are elements 0..15, high ones 16..31."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=1).reshape(qs.shape[0], 32).float()


# The decoders below build one float32 tensor and scale it in place: fewer passes over
# memory than chained out-of-place ops, which is most of the load time.

def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # block of 32: d f16 | qs[16] (nibbles); value = (q - 8) * d
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]).sub_(8.0).mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # block of 32: d f16 | m f16 | qs[16] (nibbles); value = q * d + m
    dm = _f16(b[:, 0:4])  # [n, 2]
    return _nibbles(b[:, 4:20]).mul_(dm[:, 0:1]).add_(dm[:, 1:2])


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] uint8 (a little-endian uint32) -> [n, 32] float32 of bit j * 16."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    bits = (qh.unsqueeze(-1) >> shifts) & 1  # [n, 4, 8]: byte i bit k = bit 8i+k
    return bits.reshape(qh.shape[0], 32).float().mul_(16.0)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # block of 32: d f16 | qh u32 (the 5th bit of element j is bit j) | qs[16] (nibbles)
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 6:22]).add_(_high_bits(b[:, 2:6])).sub_(16.0).mul_(d)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # block of 32: d f16 | m f16 | qh u32 | qs[16]; value = q * d + m
    dm = _f16(b[:, 0:4])
    return _nibbles(b[:, 8:24]).add_(_high_bits(b[:, 4:8])).mul_(dm[:, 0:1]).add_(dm[:, 1:2])


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # block of 32: d f16 | qs int8[32]
    d = _f16(b[:, 0:2])
    return b[:, 2:34].contiguous().view(torch.int8).float().mul_(d)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K packed 6-bit scales: [n, 12] uint8 -> (scale [n, 8], min [n, 8]) float32.

    Sub-blocks 0..3 keep the low 6 bits of bytes 0..3 (scale) and 4..7 (min); sub-blocks
    4..7 take 4 bits from bytes 8..11 and their top 2 bits from the high bits of bytes
    0..3 (scale) and 4..7 (min).
    """
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)), dim=1)
    mn = torch.cat((lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)), dim=1)
    return sc.float(), mn.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] uint8 -> [n, 8, 32] uint8: each 32 bytes hold two sub-blocks of 32,
    low nibbles the first, high nibbles the second."""
    qs = qs.reshape(qs.shape[0], 4, 1, 32)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(qs.shape[0], 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # super-block of 256: d f16 | dmin f16 | scales[12] | qs[128]; sub-blocks of 32,
    # value = d * scale * q - dmin * min
    n = b.shape[0]
    dd = _f16(b[:, 0:4])  # [n, 2]: d, dmin
    sc, mn = _k_scales(b[:, 4:16])
    q = _k_nibbles(b[:, 16:144]).float()
    q.mul_((dd[:, 0:1] * sc).unsqueeze(-1)).sub_((dd[:, 1:2] * mn).unsqueeze(-1))
    return q.reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # super-block of 256: d | dmin | scales[12] | qh[32] | qs[128]; the 5th bit of
    # sub-block i's element l is bit i of qh[l].
    n = b.shape[0]
    dd = _f16(b[:, 0:4])
    sc, mn = _k_scales(b[:, 4:16])
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    hi = (b[:, 16:48].unsqueeze(1) >> shifts) & 1  # [n, 8, 32]
    q = (_k_nibbles(b[:, 48:176]) | (hi << 4)).float()
    q.mul_((dd[:, 0:1] * sc).unsqueeze(-1)).sub_((dd[:, 1:2] * mn).unsqueeze(-1))
    return q.reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # super-block of 256: ql[128] | qh[64] | scales int8[16] | d f16. Two halves of 128;
    # in half h, element 32*j + l (j = 0..3, l = 0..31) takes 4 low bits from
    # ql[64h + l + 32*(j & 1)] (low nibble for j < 2, high for j >= 2) and 2 high bits
    # from qh[32h + l] bits 2j..2j+1; sub-blocks of 16 elements share one int8 scale.
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [n, half, j & 1, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)  # [n, half, -, l]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _f16(b[:, 208:210])
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # [n, half, j, l]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).float().sub_(32.0)  # [n, 2, 4, 32] = 256 in order
    q = q.reshape(n, 16, 16).mul_((d * scales).unsqueeze(-1))
    return q.reshape(n, 256)


# ggml type name -> (elements per block, bytes per block, decoder of [blocks, bytes]).
_BLOCK_DECODERS: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
}

_PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

SUPPORTED_TYPES = tuple(_PLAIN_DTYPES) + tuple(_BLOCK_DECODERS)


def bits_per_weight(type_name: str) -> float:
    if type_name in _PLAIN_DTYPES:
        return float(torch.finfo(_PLAIN_DTYPES[type_name]).bits)
    per_block, nbytes, _ = _BLOCK_DECODERS[type_name]
    return 8.0 * nbytes / per_block


def dequantize(raw: torch.Tensor, type_name: str, row_elements: int, dtype: torch.dtype,
               device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """raw [rows, row_bytes] uint8 (CPU, may be a file mapping) -> [rows, row_elements].

    `out`, when given, is the [rows, row_elements] destination (e.g. a slice of a fused
    weight); otherwise one is allocated.
    """
    rows = raw.shape[0]
    if out is None:
        out = torch.empty(rows, row_elements, dtype=dtype, device=device)
    elif tuple(out.shape) != (rows, row_elements):
        raise ValueError(f"out has shape {tuple(out.shape)}, not {(rows, row_elements)}")
    if type_name in _PLAIN_DTYPES:
        out.copy_(raw.reshape(-1).view(_PLAIN_DTYPES[type_name]).reshape(rows, row_elements))
        return out
    if type_name not in _BLOCK_DECODERS:
        raise ModelError(f"GGML tensor type {type_name} is not supported; "
                         f"supported: {', '.join(SUPPORTED_TYPES)}")
    per_block, nbytes, decode = _BLOCK_DECODERS[type_name]
    if row_elements % per_block or raw.shape[1] != row_elements // per_block * nbytes:
        raise ModelError(f"{type_name} tensor rows of {row_elements} elements do not fit its blocks")
    step = max(1, CHUNK_ELEMENTS // row_elements)
    for r0 in range(0, rows, step):
        chunk = raw[r0:r0 + step].to(out.device)
        out[r0:r0 + step] = decode(chunk.reshape(-1, nbytes)).reshape(-1, row_elements)
    return out

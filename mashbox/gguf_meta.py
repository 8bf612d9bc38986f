"""GGUF metadata read in pure Python: the header, the key/value pairs and the tensor table.

Why a reader of our own: the server process (CLI, text/, api/) reads a GGUF file's
tokenizer, chat template, architecture and context length, and must import neither torch
nor numpy; the `gguf` package imports numpy. The worker keeps `gguf` for tensor data.

Rules:
- GGUF v2 and v3, little-endian only (v1's 32-bit lengths and big-endian files are
  refused by name). Layout: magic "GGUF", u32 version, u64 tensor count, u64 key/value
  count; each pair is a string key, a u32 value type and the value; then each tensor's
  name, u32 n_dims, u64 dims, u32 ggml type, u64 offset into the data section, which
  starts at the next multiple of `general.alignment` (default 32).
- Every length and count is checked against the bytes left before it is used (and
  arrays nest at most MAX_ARRAY_DEPTH deep), so a corrupt or truncated file ends in
  GGUFMetaError naming what was being read and where, never in a huge allocation, a
  RecursionError, an IndexError or a struct.error.
- Values come out as Python values: ints, floats (float32 widened exactly), bools, str
  (strict UTF-8), and lists of them for arrays. Nothing keeps the file open or mapped.
- Tensor data is not read: a tensor's byte size comes from GGML_BLOCK_SIZES (None for a
  type not listed there), so a caller can check that the file holds every tensor.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, Optional

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # arrays of arrays: real files nest one level at most

# value type -> struct code (fixed-size scalars); 8 STRING and 9 ARRAY are read apart
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
TYPE_STRING, TYPE_ARRAY = 8, 9

# ggml tensor type -> (elements per block, bytes per block), as ggml defines them
GGML_BLOCK_SIZES = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 40),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
}


class GGUFMetaError(ValueError):
    """The file is not a GGUF file this reader takes, or it is corrupt; the message says where."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (innermost) dimension
    ggml_type: int
    offset: int  # absolute byte offset of the tensor's data in the file
    n_bytes: Optional[int]  # None for a ggml type not in GGML_BLOCK_SIZES

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFMeta:
    version: int
    fields: dict[str, Any]  # key -> value, in file order
    value_types: dict[str, int]  # key -> GGUF value type (arrays: 9)
    tensors: tuple[TensorInfo, ...] = ()
    data_offset: int = 0  # where the data section starts (aligned)
    file_size: int = 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @property
    def data_end(self) -> int:
        """The end of the last tensor's bytes (the offset alone for unknown types)."""
        return max((t.offset + (t.n_bytes or 0) for t in self.tensors), default=self.data_offset)


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf, end: int) -> None:
        self.buf = buf
        self.pos = 0
        self.end = end

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise GGUFMetaError(
                f"{what} at byte {self.pos} needs {n} bytes but the file ends at byte {self.end}"
            )

    def scalar(self, code: str, what: str):
        size = struct.calcsize("<" + code)
        self.need(size, what)
        (v,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"{what} length")
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFMetaError(f"{what} at byte {self.pos} is not valid UTF-8 ({e.reason})") from None
        self.pos += n
        return s

    def array(self, what: str, depth: int = 1) -> list:
        if depth > MAX_ARRAY_DEPTH:
            raise GGUFMetaError(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        item_type = self.scalar("I", f"{what} item type")
        count = self.scalar("Q", f"{what} length")
        if item_type in _SCALAR:
            code = _SCALAR[item_type]
            size = struct.calcsize("<" + code)
            self.need(count * size, what)
            values = list(struct.unpack_from(f"<{count}{code}", self.buf, self.pos)) if count else []
            self.pos += count * size
            return values
        if item_type == TYPE_STRING:
            self.need(count * 8, what)  # each string has at least its u64 length
            return [self.string(f"{what}[{i}]") for i in range(count)]
        if item_type == TYPE_ARRAY:
            self.need(count * 12, what)  # each inner array has at least its type and length
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]
        raise GGUFMetaError(f"{what}: unknown array item type {item_type}")

    def value(self, value_type: int, what: str):
        if value_type in _SCALAR:
            return self.scalar(_SCALAR[value_type], what)
        if value_type == TYPE_STRING:
            return self.string(what)
        if value_type == TYPE_ARRAY:
            return self.array(what)
        raise GGUFMetaError(f"{what}: unknown value type {value_type}")


def _parse(buf, size: int, with_tensors: bool) -> GGUFMeta:
    cur = _Cursor(buf, size)
    cur.need(4, "magic")
    if bytes(buf[0:4]) != MAGIC:
        raise GGUFMetaError(f"not a GGUF file (magic {bytes(buf[0:4])!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.scalar("I", "version")
    if version not in VERSIONS:
        if version & 0xFFFFFF == 0 and (version >> 24) in (1, 2, 3):
            raise GGUFMetaError("big-endian GGUF files are not supported")
        raise GGUFMetaError(f"GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors = cur.scalar("Q", "tensor count")
    n_kv = cur.scalar("Q", "key/value count")
    # each pair is at least a key length, a type and a one-byte value; each tensor at
    # least a name length, n_dims, type and offset
    cur.need(n_kv * 13, f"{n_kv} key/value pairs")
    fields: dict[str, Any] = {}
    value_types: dict[str, int] = {}
    for i in range(n_kv):
        key = cur.string(f"key #{i}")
        if key in fields:
            raise GGUFMetaError(f"key {key!r} appears twice")
        value_type = cur.scalar("I", f"type of {key!r}")
        fields[key] = cur.value(value_type, repr(key))
        value_types[key] = value_type
    if not with_tensors:
        return GGUFMeta(version, fields, value_types, file_size=size)

    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise GGUFMetaError(f"general.alignment must be a power of two, not {alignment!r}")
    cur.need(n_tensors * 24, f"{n_tensors} tensor infos")
    raw = []
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i} name")
        n_dims = cur.scalar("I", f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFMetaError(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        cur.need(8 * n_dims, f"dims of tensor {name!r}")
        shape = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
        cur.pos += 8 * n_dims
        ggml_type = cur.scalar("I", f"type of tensor {name!r}")
        offset = cur.scalar("Q", f"offset of tensor {name!r}")
        if offset % alignment:
            raise GGUFMetaError(f"tensor {name!r}: offset {offset} is not a multiple of {alignment}")
        raw.append((name, tuple(shape), ggml_type, offset))
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, offset in raw:
        n = 1
        for d in shape:
            n *= d
        n_bytes = None
        if ggml_type in GGML_BLOCK_SIZES:
            block, type_size = GGML_BLOCK_SIZES[ggml_type]
            if shape[0] % block:
                raise GGUFMetaError(f"tensor {name!r}: first dimension {shape[0]} is not a "
                                    f"multiple of its type's block of {block}")
            n_bytes = n // block * type_size
        tensors.append(TensorInfo(name, shape, ggml_type, data_offset + offset, n_bytes))
    return GGUFMeta(version, fields, value_types, tuple(tensors), data_offset, size)


def read(path, tensors: bool = True) -> GGUFMeta:
    """The metadata of the GGUF file at path (tensors=False: stop after the key/value pairs).

    Raises GGUFMetaError for a file that is not GGUF v2/v3 or is corrupt, OSError when it
    cannot be opened.
    """
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFMetaError(f"not a GGUF file ({size} bytes; the header alone is 24)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(mm, size, tensors)

"""mashbox.gguf_meta against gguf's own reader, and on corrupt files.

- The default model and files written here with gguf.GGUFWriter (every value type,
  arrays of each, nested arrays, several tensor types, v2 and v3): the same keys, values
  and tensor table (name, shape, type, absolute offset, byte size) as gguf.GGUFReader.
- GGML_BLOCK_SIZES agrees with gguf's GGML_QUANT_SIZES for every type it lists.
- Corrupt files (every truncation of the metadata, flipped bytes, lengths that claim
  more than the file holds, unknown types, v1 and big-endian headers) raise
  GGUFMetaError, never another exception, and never allocate what a length claims.
"""
from __future__ import annotations

import random
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

from mashbox import gguf_meta
from mashbox.gguf_meta import GGUFMetaError


def _gguf_fields(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _assert_same_as_gguf(path, flattened=()) -> gguf_meta.GGUFMeta:
    """flattened: keys of nested arrays, which gguf's contents() flattens into one list."""
    meta = gguf_meta.read(path)
    reader = gguf.GGUFReader(str(path))
    want = _gguf_fields(reader)
    assert list(meta.fields) == list(want)
    for key, value in want.items():
        if key in flattened:
            assert [x for inner in meta.fields[key] for x in inner] == value, key
            continue
        assert meta.fields[key] == value, key
        assert meta.value_types[key] == int(reader.fields[key].types[0]), key
    assert meta.version == int(reader.fields["GGUF.version"].contents())
    assert len(meta.tensors) == len(reader.tensors)
    for mine, theirs in zip(meta.tensors, reader.tensors):
        assert mine.name == theirs.name
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.ggml_type == int(theirs.tensor_type)
        assert mine.offset == theirs.data_offset
        assert mine.n_bytes == int(theirs.n_bytes)
        assert mine.n_elements == int(theirs.n_elements)
    assert meta.data_offset == reader.data_offset
    return meta


def _write_all_types(path, version: int = 3) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo <|im_end|> \u2603")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25, 3.0e-8])
    w.add_array("t.strs", ["a", "", "ü", "<think>"])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8_0", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if version != 3:
        with open(path, "r+b") as f:
            f.seek(4)
            f.write(struct.pack("<I", version))


def test_default_model_matches_gguf(default_model_path):
    meta = _assert_same_as_gguf(default_model_path)
    assert meta.get("general.architecture") == "llama"
    assert len(meta.get("tokenizer.ggml.tokens")) == 49152
    assert meta.data_end <= meta.file_size


@pytest.mark.parametrize("version", [2, 3])
def test_every_value_type_matches_gguf(tmp_path, version):
    path = tmp_path / "all.gguf"
    _write_all_types(path, version)
    meta = _assert_same_as_gguf(path, flattened=("t.nested",))
    assert meta.version == version
    assert meta.get("t.u64") == 2**63 + 5 and meta.get("t.bool") is True
    assert meta.get("t.nested") == [[1, 2], [3]]
    assert meta.get("t.f32") == float(np.float32(0.1))


def test_block_sizes_agree_with_gguf():
    theirs = {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
    for ggml_type, sizes in gguf_meta.GGML_BLOCK_SIZES.items():
        assert theirs[ggml_type] == sizes, ggml_type


def test_metadata_only_stops_before_the_tensors(tmp_path):
    path = tmp_path / "all.gguf"
    _write_all_types(path)
    meta = gguf_meta.read(path, tensors=False)
    assert meta.tensors == () and meta.get("t.str") == "héllo <|im_end|> \u2603"


def test_every_truncation_of_the_metadata_is_a_clear_error(tmp_path):
    path = tmp_path / "all.gguf"
    _write_all_types(path)
    data = path.read_bytes()
    meta = gguf_meta.read(path)
    bad = tmp_path / "cut.gguf"
    # the tensor table ends somewhere in the last alignment's worth before data_offset
    for n in range(0, meta.data_offset - gguf_meta.DEFAULT_ALIGNMENT):
        bad.write_bytes(data[:n])
        with pytest.raises(GGUFMetaError):
            gguf_meta.read(bad)
    # past it, the metadata reads and the tensors are seen not to fit
    for n in range(meta.data_offset, meta.data_end, 7):
        bad.write_bytes(data[:n])
        cut = gguf_meta.read(bad)
        assert cut.fields == meta.fields and cut.data_end > cut.file_size == n


def test_flipped_bytes_give_a_value_or_a_clear_error(tmp_path):
    path = tmp_path / "all.gguf"
    _write_all_types(path)
    data = path.read_bytes()
    meta_end = gguf_meta.read(path).data_offset
    rng = random.Random(0)
    bad = tmp_path / "flip.gguf"
    errors = 0
    for _ in range(400):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(meta_end)] = rng.randrange(256)
        bad.write_bytes(bytes(b))
        try:
            gguf_meta.read(bad)
        except GGUFMetaError:
            errors += 1
    assert errors > 0


def _header(version=3, n_tensors=0, n_kv=1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize("body, match", [
    (_header(n_kv=2**60), "key/value pairs"),
    (_header() + struct.pack("<Q", 2**62) + b"\0" * 16, "key #0"),
    (_header() + _key("k") + struct.pack("<I", 8) + struct.pack("<Q", 2**40) + b"ab", "'k'"),
    (_header() + _key("k") + struct.pack("<II", 9, 5) + struct.pack("<Q", 2**61), "'k'"),
    (_header() + _key("k") + struct.pack("<II", 9, 8) + struct.pack("<Q", 2**60), "'k'"),
    (_header() + _key("k") + struct.pack("<I", 13) + b"\0" * 8, "unknown value type 13"),
    (_header() + _key("k") + struct.pack("<II", 9, 77) + struct.pack("<Q", 1) + b"\0" * 8, "unknown array item type"),
    (_header() + _key("k") + struct.pack("<I", 8) + struct.pack("<Q", 2) + b"\xff\xfe", "UTF-8"),
    (_header(n_kv=2) + (_key("k") + struct.pack("<IB", 0, 1)) * 2, "twice"),
    (_header(n_tensors=2**59, n_kv=0), "tensor infos"),
    (_header(n_tensors=1, n_kv=0) + _key("t") + struct.pack("<I", 9) + b"\0" * 96, "dimensions"),
    (_header(n_tensors=1, n_kv=0) + _key("t") + struct.pack("<IQIQ", 1, 32, 0, 3) + b"\0" * 64, "multiple of 32"),
    (_header(n_tensors=1, n_kv=0) + _key("t") + struct.pack("<IQIQ", 1, 33, 2, 0) + b"\0" * 64, "block of 32"),
    (_header(version=1), "version 1"),
    (_header() + _key("k") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000, "nested deeper"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    (b"GGML" + b"\0" * 40, "not a GGUF file"),
    (b"GGUF", "not a GGUF file"),
])
def test_corrupt_headers_are_named(tmp_path, body, match):
    path = tmp_path / "bad.gguf"
    path.write_bytes(body)
    with pytest.raises(GGUFMetaError, match=match):
        gguf_meta.read(path)


def test_empty_arrays_and_strings(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(_header(n_kv=2) + _key("a") + struct.pack("<IIQ", 9, 5, 0)
                     + _key("s") + struct.pack("<IQ", 8, 0))
    meta = gguf_meta.read(path)
    assert meta.fields == {"a": [], "s": ""} and meta.tensors == ()


def test_reads_without_numpy(default_model_path):
    code = ("import sys; from mashbox import gguf_meta; m = gguf_meta.read(sys.argv[1]); "
            "assert len(m.tensors) > 0; print(sorted(k for k in ('numpy', 'gguf', 'torch') if k in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, default_model_path], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"

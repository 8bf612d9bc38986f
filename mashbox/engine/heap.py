"""The worker's C heap: freed load-time memory handed back to the OS.

Loading a model parses the GGUF's metadata (the vocabulary and merges: ~100k strings),
builds the tokenizer and the grammar tokenizer, and frees most of it again; glibc keeps
the freed pages, so the worker's resident memory stays ~50 MB above what it holds
(benchmarks/quant.py measured it on SmolLM2-1.7B's shape). malloc_trim(0) returns every
whole free page of the heap, once, after the load.
"""
from __future__ import annotations

import ctypes
import sys


def trim() -> bool:
    """Give the C heap's free pages back to the OS; False where glibc's malloc_trim is absent."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and other libcs have none
        return False
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    fn(0)
    return True

"""cffi builder for mashbox._native (setup.py: cffi_modules=["csrc/build.py:ffibuilder"]).

The cdef is csrc/mashbox.h itself, less its preprocessor lines, so the header stays the
one statement of the C API. Flags stay portable (no -march=native); -ffp-contract=off
keeps the compiler from fusing multiply-adds, which would change roundings that the
parity tests compare bit for bit against mashbox/native_ref.py.
"""
import os
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("sample.c", "mask.c", "stop.c", "prefix.c", "linear.c", "attention.c", "layers.c", "quant.c",
           "kquant.c", "amx.c", "lanes.c")


def _cdef() -> str:
    with open(os.path.join(HERE, "mashbox.h"), encoding="utf-8") as f:
        return "".join(line for line in f if not line.lstrip().startswith("#"))


def _path(name: str) -> str:
    # setuptools wants sources relative to the project root (the cwd of setup.py)
    full = os.path.join(HERE, name)
    try:
        return os.path.relpath(full)
    except ValueError:  # another drive on Windows
        return full


if sys.platform == "win32":
    FLAGS = ["/O2", "/fp:precise"]
else:
    # -fno-trapping-math lets the weight loop vectorise; it changes no rounding
    FLAGS = ["-O3", "-std=c99", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math"]

ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "mashbox._native",
    '#include "mashbox.h"',
    sources=[_path(s) for s in SOURCES],
    include_dirs=[_path("")],
    depends=[_path("mashbox.h"), _path("bf16.h"), _path("ggml_blocks.h"), _path("widen.h")],
    extra_compile_args=FLAGS,
    libraries=[] if sys.platform == "win32" else ["m"],  # sqrt in linear.c
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

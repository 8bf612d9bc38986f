# setup.py's only job: build csrc/ into mashbox._native with cffi. Everything else
# lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["csrc/build.py:ffibuilder"])

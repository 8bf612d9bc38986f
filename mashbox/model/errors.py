"""The one error type of the model layer.

A ModelError means the weights cannot be used: a missing or corrupt file, an
architecture or quantization we do not implement, tensors that do not match the config.
The message names the file, tensor or field. The CLI maps it to exit code 2; the worker
reports it in its failed ready frame (HTTP 500 for anything still waiting).
"""
from __future__ import annotations


class ModelError(Exception):
    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

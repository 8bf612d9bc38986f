"""A token's raw bytes, as it adds to the output text: what logprobs report per token.

Rules:
- Byte-level vocabularies (GPT-2 / Llama 3 / Qwen / SmolLM: the ByteLevel decoder) spell
  each byte with one printable character: the bytes are that spelling undone. One
  token may hold part of a multi-byte character (an emoji is often 4 tokens), so a
  token's bytes need not be valid UTF-8 alone.
- SentencePiece vocabularies: `<0xNN>` is the byte NN, "\u2581" is a space, the rest is
  the piece's UTF-8.
- Added tokens are their content; special tokens that produce no text (detok.skipped_ids:
  EOS, control tokens) are b"", so the bytes of a request's tokens add up to its text.
- `text(id)` is the bytes as a string, with bytes that do not complete a character
  written as \\xNN (OpenAI's spelling of such a token).
- Looked up on demand and kept per instance (one per request that asks for logprobs).
"""
from __future__ import annotations

import re

from tokenizers import decoders

from mashbox.text.detok import skipped_ids
from mashbox.text.tokenizer import Tokenizer, _byte_to_unicode

_BYTE_OF_CHAR = {c: b for b, c in _byte_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._hf = tokenizer.hf
        self._byte_level = isinstance(tokenizer.hf.decoder, decoders.ByteLevel)
        skip = tokenizer._detok_skip
        if skip is None:
            skip = skipped_ids(tokenizer)
            tokenizer._detok_skip = skip
        self._skip = skip
        self._added = {i: t.content for i, t in tokenizer.hf.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def of(self, tid: int) -> bytes:
        b = self._cache.get(tid)
        if b is None:
            b = self._cache[tid] = self._lookup(tid)
        return b

    def text(self, tid: int) -> str:
        return self.of(tid).decode("utf-8", "backslashreplace")

    def _lookup(self, tid: int) -> bytes:
        if tid in self._skip:
            return b""
        if tid in self._added:
            return self._added[tid].encode()
        piece = self._hf.id_to_token(tid)
        if piece is None:
            return b""
        if self._byte_level:
            if all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            return piece.encode()
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

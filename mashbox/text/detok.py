"""Incremental detokenization: new token ids -> the new complete text, per step.

Rules:
- Decoding one token at a time is wrong twice over: a character may span several byte
  tokens (an emoji is 4 byte-level tokens), and a SentencePiece decoder drops the leading
  space of the first token it sees. So each step decodes a short window of ids: from
  `prefix_offset` (a few tokens back, already shown) to the end, and subtracts the text
  of the same window up to `read_offset` (the end of what was shown).
- The new text is released only when the window's text does not end in U+FFFD, i.e. no
  UTF-8 sequence is still open; otherwise the ids wait for the next step. `flush()` at
  the end gives what is left (with U+FFFD for bytes that never completed), so the pieces
  always add up to `decode(prompt + generated)` minus `decode(prompt)`.
- One known difference: ids that never form valid UTF-8 decode to U+FFFD either way, but
  a SentencePiece ByteFallback decoder replaces every byte of an invalid group, so the
  number of U+FFFD (and whether a stray ASCII byte inside the group shows) may differ
  from one whole decode. Valid output is always identical.
- Special tokens (EOS, control tokens) are skipped; added non-special tokens such as
  `<think>` are kept, since the output parser reads them. So are the parser's tags when a
  vocabulary marks them special (some GGUF files mark `<think>` as a control token):
  skipped ids are dropped as they arrive and the window is decoded with nothing skipped.
- Prompts are encoded from text, so they end on a character boundary; the window's
  first text is taken as already shown.
- Per token the work is one decode of a window whose length is bounded by the longest
  run of ids that do not complete a character, so it is O(1) per token; `_ids` grows by
  one int per token and is dropped with the request.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from mashbox.text.parsers import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN
from mashbox.text.tokenizer import Tokenizer

# How many prompt tokens the first window reaches back: enough context for the first new
# token's leading space, few enough to be cheap.
PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


# Special tokens whose text the output parser needs to see.
PARSER_TAGS = (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE)


def skipped_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The special-token ids that produce no text."""
    return frozenset(i for t, i in tokenizer.special_tokens.items() if t not in PARSER_TAGS)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._hf = tokenizer.hf
        skip = tokenizer._detok_skip
        if skip is None:  # computed once per tokenizer, not per request
            skip = skipped_ids(tokenizer)
            tokenizer._detok_skip = skip
        self._skip = skip
        self._ids: list[int] = [i for i in prompt_ids[-PROMPT_CONTEXT:] if i not in skip]
        self._read_offset = len(self._ids)  # ids before this are shown
        self._prefix_offset = 0  # window start: ids before this are never decoded again
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._hf.decode(self._ids[start:end], skip_special_tokens=False)

    def push(self, ids: Iterable[int]) -> str:
        """Take new ids; return the text they complete ("" while a character is open)."""
        skip = self._skip
        self._ids.extend(i for i in ids if i not in skip)
        text = self._decode(self._prefix_offset, len(self._ids))
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        new = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return new

    def flush(self) -> str:
        """At the end of generation: the text still held back (may hold U+FFFD)."""
        text = self._decode(self._prefix_offset, len(self._ids))
        if len(text) <= len(self._prefix_text):
            return ""
        new = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        return new

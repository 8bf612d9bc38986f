"""Log probabilities in the API: which tokens' logprobs go out with which text, and the
JSON shapes of the three routes that return them.

Rules:
- The worker sends one TokenLogprob per sampled token, at once (StepEvent.logprobs);
  the text of that token may still be held back (an open UTF-8 character, a possible
  stop string, a possible tag in the output parser). `TokenQueue` keeps them until
  their text is out: a token goes with the step whose pieces complete its bytes, i.e.
  when (bytes of engine text fed to the parser) - (bytes the parser still holds) reaches
  the end of the token's bytes (token_bytes.TokenBytes: they add up to the text; special
  tokens that show nothing are b"" and go with the text before them). What is left at
  the end (a stop string's tokens, EOS) goes with the last step. Never early: a token's
  logprob is never sent before its text.
- Values are the worker's: log-softmax of the logits the sampler saw, after penalties,
  before temperature; -inf is reported as -9999.0 (config.LOGPROB_FLOOR).
- Shapes: Chat and Responses `{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}` (`entry_json`); Completions the legacy `{tokens, token_logprobs,
  top_logprobs: [{token: logprob}], text_offset}` (`LegacyLogprobs`, whose text_offset
  counts characters of the completion text and keeps counting across stream chunks).
- Requests (`read_chat`, `read_completions`, `read_responses`): a bad value is a 400
  naming the field; top_logprobs above 20, or on Chat without logprobs: true, too.
"""
from __future__ import annotations

import codecs
import collections
from typing import Optional, Sequence

from mashbox.api import common
from mashbox.config import StepEvent
from mashbox.text.pieces import TokenChoice, TokenLogprobs
from mashbox.text.token_bytes import TokenBytes

MAX_TOP_LOGPROBS = 20  # native.MAX_TOP_LOGPROBS, without importing numpy into the server


class TokenQueue:
    """The tokens of one generation whose logprobs have not gone out yet (module rules)."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._tb = token_bytes
        self._pending: collections.deque[tuple[int, TokenLogprobs]] = collections.deque()  # (end byte, entry)
        self._end = 0  # bytes of every token pushed
        self._fed = 0  # bytes of engine text fed to the parser

    def _choice(self, tid: int, logprob: float) -> TokenChoice:
        return TokenChoice(self._tb.text(tid), self._tb.of(tid), logprob)

    def push(self, ev: StepEvent) -> None:
        """An engine event: its tokens (with their logprobs) and its text."""
        for tid, lp in zip(ev.token_ids, ev.logprobs):
            chosen = self._choice(tid, lp.logprob)
            self._end += len(chosen.bytes)
            top = tuple(self._choice(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs))
            self._pending.append((self._end, TokenLogprobs(chosen, top)))
        self._fed += len(ev.text.encode())

    def release(self, held_text: str) -> tuple[TokenLogprobs, ...]:
        """The tokens whose text is out, given the text the parser still holds."""
        out_to = self._fed - len(held_text.encode())
        out = []
        while self._pending and self._pending[0][0] <= out_to:
            out.append(self._pending.popleft()[1])
        return tuple(out)

    def flush(self) -> tuple[TokenLogprobs, ...]:
        out = tuple(e for _, e in self._pending)
        self._pending.clear()
        return out


def _choice_json(c: TokenChoice) -> dict:
    return {"token": c.token, "logprob": c.logprob, "bytes": list(c.bytes)}


def entry_json(e: TokenLogprobs) -> dict:
    """Chat's / Responses' shape of one token."""
    d = _choice_json(e.chosen)
    d["top_logprobs"] = [_choice_json(c) for c in e.top]
    return d


def chat_json(entries: Sequence[TokenLogprobs]) -> dict:
    """A Chat choice's `logprobs` object."""
    return {"content": [entry_json(e) for e in entries], "refusal": None}


class LegacyLogprobs:
    """Completions' logprobs objects, chunk by chunk: text_offset keeps counting."""

    def __init__(self) -> None:
        self._chars = 0  # characters of text before the next token
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def json(self, entries: Sequence[TokenLogprobs]) -> dict:
        tokens, logprobs, tops, offsets = [], [], [], []
        for e in entries:
            tokens.append(e.chosen.token)
            logprobs.append(e.chosen.logprob)
            tops.append({c.token: c.logprob for c in e.top})
            offsets.append(self._chars)
            self._chars += len(self._decoder.decode(e.chosen.bytes))
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


# -- what each route asks for (None: no logprobs, else the top alternatives per token)

RESPONSES_INCLUDE = "message.output_text.logprobs"


def _top(body: dict, name: str) -> Optional[int]:
    return common.get_int(body, name, None, lo=0, hi=MAX_TOP_LOGPROBS)


def read_chat(body: dict) -> Optional[int]:
    """Chat: `logprobs` (boolean) and `top_logprobs` (0-20, only with logprobs true)."""
    on = common.get_bool(body, "logprobs", None)
    top = _top(body, "top_logprobs")
    if top is not None and not on:
        raise common.bad_request("top_logprobs requires logprobs: true.", "top_logprobs")
    return (top or 0) if on else None


def read_completions(body: dict) -> Optional[int]:
    """Completions: `logprobs`, the number of alternatives per token (0-20; OpenAI's cap is 5)."""
    return _top(body, "logprobs")


def read_responses(body: dict) -> Optional[int]:
    """Responses: on with `include: ["message.output_text.logprobs"]` or a `top_logprobs`
    (0-20). `include` itself is checked by responses.check_unsupported."""
    top = _top(body, "top_logprobs")
    include = body.get("include")
    asked = isinstance(include, list) and RESPONSES_INCLUDE in include
    if top is None and not asked:
        return None
    return top or 0

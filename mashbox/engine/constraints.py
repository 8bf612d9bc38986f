"""The grammar matchers of the constrained requests, and the masks they put on the logits.

Rules:
- A request with a `Constraint` gets an llguidance matcher when it is submitted (a
  grammar that does not compile fails that request only); it is dropped when the
  request finishes, whatever the way.
- The step: `begin(rows)` starts computing the next-token bitmask of every constrained
  row that samples this step, on one background thread, while the forward pass runs
  (llguidance and torch both release the GIL); `apply(logits, rows)` waits for it and
  sets the disallowed logits to -inf before sampling. After sampling, `consume(id, tok)`
  advances the matcher; it says when the grammar is complete (the value is done: the
  request stops there) or broken.
- Rows without a constraint pay nothing: with no constrained row in the step, begin and
  apply return at once and nothing is allocated. A row's mask depends on its own
  matcher only (batch invariance).
- A grammar is compiled once (25 agent tools: ~0.1 s) and kept, COMPILED_MAX of them;
  each request gets a copy of the fresh matcher (microseconds).
- The llguidance tokenizer is made on the first constrained request (~0.3 s), sized to
  the model's vocabulary: ids the tokenizer lacks (padding rows) are never allowed.
- Buffers are made once: the bitmask int32[slots, ceil(vocab / 32)] (row i: the i-th
  sampled row of the step) and its bool unpacking scratch [slots, words * 32].
"""
from __future__ import annotations

import concurrent.futures
import logging
from typing import Optional, Sequence

import numpy as np

from mashbox.config import Constraint
from mashbox.text import grammar

log = logging.getLogger("mashbox.engine.constraints")

OK, DONE, BROKEN = "ok", "done", "broken"  # what consume() says of a matcher
COMPILED_MAX = 32  # grammars kept compiled (an agent sends the same tools every turn)


class ConstraintTable:
    def __init__(self, tokenizer, vocab_size: int, slots: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.bitmask = np.zeros((slots, self.words), dtype=np.int32)  # [slots, words]
        self._allowed = np.zeros((slots, self.words * 32), dtype=bool)  # [slots, words * 32]
        self._matchers: dict[str, object] = {}  # request id -> llguidance.LLMatcher
        self._compiled: dict[Constraint, object] = {}  # constraint -> an unused matcher, copied per request
        self._lltok = None
        self._executor = None  # llguidance.LLExecutor, with the tokenizer
        self._thread: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: Optional[concurrent.futures.Future] = None
        self._rows: list[int] = []  # positions (among the step's sampled rows) that are constrained

    def _ensure(self) -> None:
        if self._lltok is None:
            import llguidance

            self._lltok = grammar.ll_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            self._executor = llguidance.LLExecutor(1)
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mashbox-mask")

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def add(self, request_id: str, constraint: Constraint) -> None:
        """A matcher for a submitted request; GrammarError when it does not compile."""
        self._ensure()
        fresh = self._compiled.get(constraint)
        if fresh is None:
            fresh = grammar.matcher(constraint, self._lltok)
            if len(self._compiled) >= COMPILED_MAX:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[constraint] = fresh
        self._matchers[request_id] = fresh.deep_copy()

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._matchers

    def begin(self, sampled_ids: Sequence[str]) -> None:
        """Start the masks of the constrained rows among `sampled_ids` (the step's rows
        that sample, in order) on the mask thread."""
        if not self._matchers:
            return
        self._settle()
        pairs = [(self._matchers[rid], i) for i, rid in enumerate(sampled_ids) if rid in self._matchers]
        self._rows = [i for _, i in pairs]
        if not pairs:
            return
        import llguidance.numpy as lln

        self._pending = self._thread.submit(lln.fill_next_token_bitmask_par, self._executor, pairs, self.bitmask)

    def _settle(self) -> None:
        """Wait out a mask a failed forward left running (it writes into the bitmask)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            concurrent.futures.wait([pending])

    def apply(self, logits: np.ndarray) -> None:
        """logits: float32[n, vocab], the step's sampled rows in begin()'s order; the
        constrained rows' disallowed ids become -inf, in place."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.result()
        rows = self._rows
        vocab = logits.shape[1]
        bits = self.bitmask[rows].view(np.uint8)  # [k, words * 4]
        allowed = self._allowed[: len(rows)]
        allowed[:] = np.unpackbits(bits, axis=1, bitorder="little").view(bool)
        for k, i in enumerate(rows):
            np.putmask(logits[i], ~allowed[k, :vocab], -np.inf)

    def consume(self, request_id: str, token: int) -> str:
        """Advance a request's matcher by its sampled token: OK, DONE (the grammar admits
        nothing more: the value is complete) or BROKEN (the token was not allowed)."""
        m = self._matchers.get(request_id)
        if m is None:
            return OK
        if not m.consume_token(token):
            log.warning("request %s: token %d broke its grammar: %s", request_id, token, m.get_error())
            return BROKEN
        return DONE if m.is_stopped() else OK

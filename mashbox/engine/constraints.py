"""The grammar matchers of the constrained requests, and the masks they put on the logits.

Rules:
- A request with a `Constraint` gets an llguidance matcher when it is submitted. A
  grammar compiled before (COMPILED_MAX are kept: an agent sends the same tools every
  turn) gives it a copy at once (microseconds); a new one is compiled on the grammar
  thread, off the step: `add` says the request must wait, the worker holds it back from
  the scheduler and `compiled()` hands it over once its matcher is made (or its grammar
  failed: that request fails alone). The other rows go on decoding meanwhile
  (llguidance drops the GIL while it compiles). A matcher is dropped when its request
  finishes, whatever the way.
- The llguidance tokenizer is built once, on the grammar thread, when the table is
  made (the worker's start-up; ~0.3 s that holds the GIL, so never during a step), sized
  to the model's vocabulary: ids the tokenizer lacks (padding rows) are never allowed.
- Two ways to put a grammar on a row, chosen once per request (`checks_after`):
  * masked first: `begin(rows)` hands the next-token bitmask of the row to the mask
    thread (one thread, started once, fed before the forward), which computes it while
    the forward pass runs (llguidance and the forward both drop the GIL); `apply(logits)`
    joins it and sets the disallowed logits to -inf in C (native.apply_token_bitmask)
    before sampling.
  * checked after: the row samples from its unmasked logits and `check(tokens, logits)`
    asks its matcher whether the token is allowed (a few microseconds); only a refused
    row gets its mask, then (on the caller's thread, the forward is over) and is sampled
    again from the masked logits. A mask costs ~15-650 us of CPU (a JSON string: the
    whole vocabulary is walked), and on a machine whose cores all run the forward that
    time is taken from the forward, at batch 8 most of the constrained slow-down; the
    model's own pick is allowed almost always. The draw is the masked draw: greedy, the
    first maximum of all logits, when allowed, is the first maximum of the allowed ones;
    with temperature alone, a draw from the unmasked softmax kept when allowed, else
    drawn again from the masked one, is a draw from the masked distribution (rejection
    sampling: p(t) + (1 - Z) p(t) / Z = p(t) / Z, Z the allowed mass). Not for top_k,
    top_p or min_p (they cut the distribution before the mask renormalises it), nor
    penalties (the sampler penalises the logits in place: a second draw would penalise
    twice), nor logprobs (they are of the masked logits): those rows are masked first.
  After sampling, `consume(id, tok)` advances the matcher; it says when the grammar is
  complete (the value is done: the request stops there) or broken.
- Rows without a constraint pay nothing: with no constrained row in the step, begin and
  apply return at once. A row's mask depends on its own matcher only (batch invariance).
- Buffers are made once: the bitmask int32[slots, ceil(vocab / 32)] (row i: the i-th
  sampled row of the step) and the rows' mask index int32[slots] (-1: unconstrained).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Optional, Sequence

import numpy as np

from mashbox import native
from mashbox.config import Constraint, SamplingParams
from mashbox.text import grammar

log = logging.getLogger("mashbox.engine.constraints")

OK, DONE, BROKEN = "ok", "done", "broken"  # what consume() says of a matcher
COMPILED_MAX = 32  # grammars kept compiled (an agent sends the same tools every turn)


def checks_after(sampling: SamplingParams, logprobs: Optional[int]) -> bool:
    """True when a row under a grammar may sample from its unmasked logits and be checked
    after (module rules): greedy or temperature alone, no penalties, no logprobs."""
    return (logprobs is None and sampling.top_k == 0 and sampling.top_p >= 1.0 and sampling.min_p <= 0.0
            and sampling.repetition_penalty == 1.0 and sampling.frequency_penalty == 0.0
            and sampling.presence_penalty == 0.0)


class _MaskThread:
    """One thread, started once, that fills bitmask rows while the caller does something
    else (the forward). start() hands it a job, join() waits for it; two locks used as
    binary semaphores make the hand-off (cheaper than a pool's futures per step). All
    the rows are one llguidance call, which drops the GIL once: a call per row would
    take the GIL back between rows, and each take can make the forward's thread wait
    for it (a switch interval, or a time slice on a busy machine)."""

    def __init__(self, bitmask: np.ndarray) -> None:
        import llguidance
        import llguidance.numpy as lln

        self._fill = lln.fill_next_token_bitmask_par
        self._bitmask = bitmask  # int32[rows, words], written by the job
        self._executor = llguidance.LLExecutor(1)
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._pairs: Optional[list] = None
        self._error: Optional[BaseException] = None
        self.busy = False
        threading.Thread(target=self._run, name="mashbox-mask", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            try:
                self._fill(self._executor, self._pairs, self._bitmask)
            except BaseException as exc:  # noqa: BLE001 - handed to join()'s caller
                self._error = exc
            self._pairs = None
            self._done.release()

    def start(self, pairs: list) -> None:
        """pairs: (matcher, bitmask row) each."""
        self._pairs = pairs
        self.busy = True
        self._go.release()

    def join(self) -> None:
        if not self.busy:
            return
        self._done.acquire()
        self.busy = False
        error, self._error = self._error, None
        if error is not None:
            raise error


class ConstraintTable:
    def __init__(self, tokenizer, vocab_size: int, slots: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.bitmask = np.zeros((slots, self.words), dtype=np.int32)  # [slots, words]
        self._row_mask = np.full(slots, -1, dtype=np.int32)  # [slots]: sampled row -> its bitmask row, -1 = free
        self._matchers: dict[str, object] = {}  # request id -> llguidance.LLMatcher
        self._compiled: dict[Constraint, object] = {}  # constraint -> an unused matcher, copied per request
        # request id -> (its constraint, its compile on the grammar thread)
        self._compiling: dict[str, tuple[Constraint, concurrent.futures.Future]] = {}
        # the grammar thread: the tokenizer first, then the compiles, in order
        self._grammar_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mashbox-grammar")
        self._lltok = self._grammar_thread.submit(grammar.ll_tokenizer, tokenizer, vocab_size)
        self._mask = _MaskThread(self.bitmask)
        # bitmask row i's address: check() has llguidance write a refused row's mask there
        self._row_addr = [self.bitmask.ctypes.data + i * self.bitmask.strides[0] for i in range(slots)]
        self._after: set[str] = set()  # request ids whose rows are checked after sampling
        self._first_rows: list[int] = []  # this step's masked-first rows: positions among the sampled rows
        self._after_pairs: list[tuple[object, int]] = []  # this step's checked rows: (matcher, position)
        self.checked = 0  # tokens checked after sampling, since the start
        self.refused = 0  # of them, refused (masked and sampled again)

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def wait_tokenizer(self, timeout: Optional[float] = None) -> None:
        """Block until the llguidance tokenizer is built (or failed: the constrained
        requests then fail alone), so it never holds the GIL during a step."""
        concurrent.futures.wait([self._lltok], timeout)

    def add(self, request_id: str, constraint: Constraint, check_after: bool = False) -> bool:
        """A matcher for a submitted request: True when it is ready now (a grammar compiled
        before); False when it is being compiled (compiled() says when it is done).
        check_after: its rows sample unmasked and are checked after (`checks_after`)."""
        if check_after:
            self._after.add(request_id)
        fresh = self._compiled.get(constraint)
        if fresh is not None:
            self._matchers[request_id] = fresh.deep_copy()
            return True
        self._compiling[request_id] = (constraint, self._grammar_thread.submit(self._compile, constraint))
        return False

    def _compile(self, constraint: Constraint):
        """On the grammar thread: the fresh matcher of a constraint (kept for the next
        request with it); GrammarError when it does not compile."""
        fresh = self._compiled.get(constraint)  # compiled meanwhile for another request
        if fresh is None:
            fresh = grammar.matcher(constraint, self._lltok.result())
        return fresh

    def compiled(self) -> list[tuple[str, Optional[str]]]:
        """(request id, None or why its grammar failed) of each compile that ended since
        the last call; a request whose compile succeeded now has its matcher."""
        out = []
        for rid, (constraint, fut) in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            try:
                fresh = fut.result()
            except ValueError as exc:  # GrammarError, or llguidance's own
                self._after.discard(rid)
                out.append((rid, str(exc) or type(exc).__name__))
                continue
            except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer failed: this request fails, not the worker
                self._after.discard(rid)
                log.exception("request %s: its grammar could not be compiled", rid)
                out.append((rid, f"the grammar could not be compiled: {type(exc).__name__}: {exc}"))
                continue
            if constraint not in self._compiled:
                if len(self._compiled) >= COMPILED_MAX:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[constraint] = fresh
            self._matchers[rid] = fresh.deep_copy()
            out.append((rid, None))
        return out

    def wait_compiles(self, timeout: float) -> None:
        """Block until a compile ends or `timeout` seconds pass (the worker has nothing
        else to do)."""
        if self._compiling:
            concurrent.futures.wait([f for _, f in self._compiling.values()], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._after.discard(request_id)
        pending = self._compiling.pop(request_id, None)
        if pending is not None:
            pending[1].cancel()  # one already running ends unused

    def has(self, request_id: str) -> bool:
        return request_id in self._matchers

    def begin(self, sampled_ids: Sequence[str]) -> None:
        """Start the masks of the masked-first rows among `sampled_ids` (the step's rows
        that sample, in order) on the mask thread; the checked rows wait for check()."""
        self._mask.join()  # a mask a failed forward left running (it writes into the bitmask)
        first, after = [], []
        matchers, checked = self._matchers, self._after
        for i, rid in enumerate(sampled_ids):
            m = matchers.get(rid)
            if m is not None:
                (after if rid in checked else first).append((m, i))
        self._first_rows = [i for _, i in first]
        self._after_pairs = after
        if first:
            self._mask.start(first)

    def apply(self, logits: np.ndarray) -> None:
        """logits: float32[n, vocab], the step's sampled rows in begin()'s order; the
        constrained rows' disallowed ids become -inf, in place."""
        if not self._mask.busy:
            return
        self._mask.join()
        n = logits.shape[0]
        row_mask = self._row_mask[:n]
        row_mask.fill(-1)
        row_mask[self._first_rows] = self._first_rows  # sampled row i reads bitmask row i
        native.apply_token_bitmask(logits, self.bitmask, row_mask)

    def check(self, tokens: Sequence[int], logits: np.ndarray) -> list[int]:
        """After sampling (tokens: the step's sampled ids, logits: float32[n, vocab] as in
        apply): the positions of the checked rows whose grammar refuses their token. Their
        masks are applied to `logits` in place: the caller samples those rows again."""
        pairs, self._after_pairs = self._after_pairs, []
        if not pairs:
            return []
        refused = [(m, i) for m, i in pairs if not m.validate_tokens([tokens[i]])]
        self.checked += len(pairs)
        if not refused:
            return []
        self.refused += len(refused)
        # on this thread, one row after another: the forward is over, and a hand-off to the
        # mask thread would cost a wake-up. No job of this step writes checked rows' bitmask rows.
        row_bytes = self.words * 4
        for m, i in refused:
            m.unsafe_compute_mask_ptr(self._row_addr[i], row_bytes)
        rows = [i for _, i in refused]
        row_mask = self._row_mask[: logits.shape[0]]
        row_mask.fill(-1)
        row_mask[rows] = rows
        native.apply_token_bitmask(logits, self.bitmask, row_mask)
        return rows

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

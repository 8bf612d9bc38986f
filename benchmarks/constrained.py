"""Constrained against unconstrained decode throughput, batch 1 and 8, side by side.

Runs the engine in process (the worker's Engine: scheduler, runner, the llguidance
masks computed on their thread during the forward, native sampling). Each round runs,
at batch 1 and at batch 8, the same prompts greedy with ignore_eos, once free and once
under a JSON schema that cannot complete within the token budget (an array of at least
64 objects), so every row decodes to max_tokens either way. Only steps where every row
decodes are timed; the best round of each counts (other load only slows a round down).

    constrained: b1 <free> / <json> tok/s (<r>%) | b8 <free> / <json> tok/s (<r>%) | load ...

Goal: >= 95% at both batch sizes. Also printed: the mean time per constrained step
from the end of the forward to sampling (waiting for the mask thread, when it took
longer than the forward, plus the mask's C pass over the logits). The set-up and the
timing loop are benchmarks/engine_rate.py's, shared with benchmarks/decode.py.

Usage: python benchmarks/constrained.py [--model PATH] [--tokens 48] [--repeat 3] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# the repository root instead of this folder: benchmarks/http.py would shadow the stdlib
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks import engine_rate  # noqa: E402
from mashbox.config import Constraint  # noqa: E402
PROMPTS = [
    "List people with their names and ages as JSON.",
    "Give me a JSON array of employees.",
    "Write example user records in JSON.",
    "Produce a JSON list of students and their ages.",
    "Return a list of authors as JSON objects.",
    "Make a JSON array of customers.",
    "Output family members as JSON.",
    "Create JSON test data for people.",
]
SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"]}}


class MaskTimer:
    """Wraps the ConstraintTable's apply and check: the wait for the mask thread after the
    forward plus the mask's C pass over the logits, and the check of the rows sampled
    unmasked (with the masks of the refused ones)."""

    def __init__(self, table) -> None:
        self.waited = 0.0
        table.apply = self._timed(table.apply)
        table.check = self._timed(table.check)

    def _timed(self, f):
        def timed(*args):
            t0 = time.perf_counter()
            out = f(*args)
            self.waited += time.perf_counter() - t0
            return out
        return timed


CONSTRAINT = Constraint("json_schema", json.dumps(SCHEMA))


def decode_rate(engine, batch: int, tokens: int, tag: str, constrained: bool) -> float:
    """Aggregate tokens/s over the steps where all `batch` rows decode."""
    return engine_rate.decode_rate(engine, PROMPTS, batch, tokens, tag,
                                   constraint=CONSTRAINT if constrained else None).tok_s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the default model)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (interleaved); the best of each counts")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    engine = engine_rate.make_engine(args.model, threads=args.threads)
    decode_rate(engine, 1, 8, "warm", False)
    decode_rate(engine, 2, 8, "warmc", True)  # compiles the grammar (kept for the timed rounds)
    timer = MaskTimer(engine.constraints)
    best = {(b, c): 0.0 for b in (1, 8) for c in (False, True)}
    masked_steps = 0
    for i in range(args.repeat):
        for b in (1, 8):
            for c in (False, True):
                before = engine.steps
                best[b, c] = max(best[b, c], decode_rate(engine, b, args.tokens, f"b{b}{'c' if c else 'f'}{i}", c))
                if c:
                    masked_steps += engine.steps - before
    parts = []
    for b in (1, 8):
        free, con = best[b, False], best[b, True]
        parts.append(f"b{b} {free:.1f} / {con:.1f} tok/s ({100 * con / free:.1f}%)")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"constrained: {' | '.join(parts)} | load {load}")
    table = engine.constraints
    print(f"after the forward: {1e3 * timer.waited / max(masked_steps, 1):.3f} ms per constrained step "
          f"(mask wait, apply, check); {table.refused} of {table.checked} tokens sampled unmasked were "
          f"refused and drawn again")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

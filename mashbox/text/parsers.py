"""The output parser: model text, as it streams, -> text, reasoning and tool-call pieces.

(Over 450 lines: one state machine and the JSON scanner of its CALL state, which works on
the parser's own buffer and positions; split apart, both would share that state.)

States and transitions (the table `TRANSITIONS`; a state watches only the tags of the
features turned on):

    TEXT      --<think>-->      REASONING      (reasoning=True)
    TEXT      --<tool_call>-->  CALL           (tools=True)
    REASONING --</think>-->     TEXT
    CALL      --</tool_call>--> TEXT           (found outside JSON strings; see below)

Rules:
- Nothing streamed is ever taken back. Text that may still become a tag (a suffix that is
  a prefix of a watched tag) is held back, and so is trailing whitespace, because:
- Whitespace that touches a tag is dropped: the leading whitespace of a section that a
  tag opened (reasoning after <think>, text after </think> or after a call) and the
  trailing whitespace before a tag. Text at the very end of the output keeps its
  trailing whitespace; unclosed reasoning at the end loses it.
- A call's body is `{"name": "...", "arguments": {...}}` (key order free; "parameters"
  is read as "arguments"). It is scanned as JSON, character by character outside
  strings. The call is *committed* when its "name" string is complete: ToolCallStart
  goes out then (index, id, name), with any argument text already seen. From then on the
  arguments object streams as JSON-text deltas (the deltas concatenate to the arguments
  exactly as the model wrote them, from `{` to its `}`); a string-valued "arguments"
  (JSON in a string) is decoded and sent whole when it closes; `null` or missing
  arguments are sent as "{}". ToolCallEnd closes the call with the whole arguments text
  and whether it parses as a JSON object.
- A call ends at `</tool_call>` outside a JSON string, or, once the body's object has
  closed, at anything other than whitespace (the rest is text again: models often go
  straight on to the next `<tool_call>`), or at the end of the output.
- Malformed calls. Before the call is committed (no complete "name" yet), a body that
  is not JSON, or a call that ends without a name, is plain text: the tag and the body
  go out as Text exactly as written. After the commit a call cannot be taken back: if
  the body's own JSON breaks (a bad character between keys and values), argument
  streaming stops, the rest up to `</tool_call>` (or the end) is dropped, and
  ToolCallEnd says valid=False. Inside the arguments value only brackets and strings
  are tracked (to find its end); arguments that do not parse as a JSON object, or are
  cut off by the end of the output (max_tokens), also end with valid=False.
- Priming: a prompt that already holds the start of the model's answer (an opened
  <think>, or a forced `<tool_call>{"name": "x", "arguments": `) is handled by
  `in_reasoning=True` or by feeding that text first: the parser reads it as output.
- Pieces are text/pieces.py's `Piece` values (kinds text | reasoning | tool_start |
  tool_args | tool_end); api/generation.py yields them as they are and the api writers
  read them.
- Tool-call ids are minted here, once, when a call is committed: the route's prefix
  (`id_prefix`: call_ / toolu_ / fc_) and 24 hex characters; every piece of the call
  carries it.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import re
from typing import Callable, Optional

from mashbox.text.pieces import (  # noqa: F401 - the pieces are the parser's output: importable from here
    Piece,
    Reasoning,
    Text,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


# -- the state table --------------------------------------------------------------------------
class State(enum.Enum):
    TEXT = "text"
    REASONING = "reasoning"
    CALL = "call"


TRANSITIONS: dict[tuple[State, str], State] = {
    (State.TEXT, THINK_OPEN): State.REASONING,
    (State.TEXT, CALL_OPEN): State.CALL,
    (State.REASONING, THINK_CLOSE): State.TEXT,
    (State.CALL, CALL_CLOSE): State.TEXT,
}


class ParserError(RuntimeError):
    """An illegal transition: a bug in the parser, never caused by model output."""


# -- the call body scanner ----------------------------------------------------------------
class _Phase(enum.Enum):
    OPEN = "open"  # before the body's `{`
    KEY_OR_END = "key_or_end"  # after `{` or `,`: a key or `}`
    KEY = "key"  # inside a key string
    COLON = "colon"
    VALUE_START = "value_start"
    VALUE = "value"  # inside a value (string, container or primitive)
    AFTER = "after"  # after a value: `,` or `}`
    DONE = "done"  # the body's object closed; `</tool_call>` may follow
    BROKEN = "broken"  # committed, then malformed: skip to `</tool_call>`


_WS = " \t\r\n"
_STRING_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'[{}\[\]"<]')
_PRIMITIVE_STOP = re.compile(r"[,}\]\s<]")


class _Call:
    """One call being scanned; positions index the parser's buffer (the body)."""

    def __init__(self, index: int, ws_before: str):
        self.index = index
        self.ws_before = ws_before  # whitespace dropped before the tag (given back if text)
        self.phase = _Phase.OPEN
        self.pos = 0
        self.key: Optional[str] = None
        self.key_start = 0
        self.value_start = 0
        self.value_kind = ""  # "container" | "string" | "primitive"
        self.depth = 0
        self.in_string = False
        self.name: Optional[str] = None
        self.id = ""
        self.committed = False
        self.args_start: Optional[int] = None  # buffer index of the arguments value
        self.args_kind = ""
        self.args_end: Optional[int] = None  # set when the arguments value is complete
        self.args_whole: Optional[str] = None  # decoded string / null / primitive args
        self.args_sent = 0  # buffer index up to which argument text has been sent
        self.args_text: list[str] = []  # everything sent, for ToolCallEnd


class OutputParser:
    """Incremental: `feed(text) -> list[Piece]` as text streams, `finish()` at the end.

    The pieces do not depend on how the text was split into feeds (apart from how
    adjacent pieces of one kind are cut).
    """

    def __init__(
        self,
        reasoning: bool = False,
        tools: bool = False,
        in_reasoning: bool = False,
        id_prefix: str = "call_",
        call_id: Optional[Callable[[], str]] = None,  # tests: fixed ids; default new_call_id(id_prefix)
        think_tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE),
        call_tags: tuple[str, str] = (CALL_OPEN, CALL_CLOSE),
    ):
        self._think_open, self._think_close = think_tags
        self._call_open, self._call_close = call_tags
        self._new_id = call_id if call_id is not None else (lambda: new_call_id(id_prefix))
        self._tags = {THINK_OPEN: self._think_open, THINK_CLOSE: self._think_close,
                      CALL_OPEN: self._call_open, CALL_CLOSE: self._call_close}
        # What each plain state watches for: [(tag text, next state)].
        self._watch: dict[State, list[tuple[str, State]]] = {State.TEXT: [], State.REASONING: []}
        if reasoning:
            self._watch[State.TEXT].append((self._think_open, State.REASONING))
        if reasoning or in_reasoning:
            self._watch[State.REASONING].append((self._think_close, State.TEXT))
        if tools:
            self._watch[State.TEXT].append((self._call_open, State.CALL))
        self._state = State.REASONING if in_reasoning else State.TEXT
        self._strip_lead = in_reasoning
        self._buf = ""
        self._call: Optional[_Call] = None
        self._num_calls = 0
        self._finished = False

    @property
    def state(self) -> State:
        return self._state

    @property
    def held_text(self) -> str:
        """The tail of the fed text not yet given out as pieces (nor dropped): the buffer,
        and while a call is not committed its tag and the whitespace before it (which go
        back out as text if the call turns out malformed)."""
        call = self._call
        if call is not None and not call.committed:
            return call.ws_before + self._call_open + self._buf
        return self._buf

    @property
    def num_calls(self) -> int:
        """Calls committed so far (ToolCallStart sent)."""
        return self._num_calls

    # -- public -------------------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        if self._finished:
            raise ParserError("feed() after finish()")
        if not text:
            return []
        self._buf += text
        out: list[Piece] = []
        self._run(out, final=False)
        return _merged(out)

    def finish(self) -> list[Piece]:
        """The held-back rest, once the output has ended."""
        if self._finished:
            return []
        out: list[Piece] = []
        self._run(out, final=True)
        self._finished = True
        return _merged(out)

    # -- driver -------------------------------------------------------------------------
    def _goto(self, state: State, tag: str) -> None:
        canonical = next((k for k, v in self._tags.items() if v == tag), tag)
        nxt = TRANSITIONS.get((self._state, canonical))
        if nxt is not state:
            raise ParserError(f"no transition {self._state.value} --{tag}--> {state.value}")
        self._state = state

    def _run(self, out: list, final: bool) -> None:
        while True:
            if self._state is State.CALL:
                if not self._scan_call(out, final):
                    return
            elif not self._scan_plain(out, final):
                return

    # -- text and reasoning ---------------------------------------------------------------
    def _scan_plain(self, out: list, final: bool) -> bool:
        """Emit what is safe in TEXT / REASONING; True when a tag moved to another state."""
        watch = self._watch[self._state]
        piece = Text if self._state is State.TEXT else Reasoning
        final_strip = self._state is State.REASONING
        while True:
            if self._strip_lead:
                rest = self._buf.lstrip()
                if not rest:
                    self._buf = ""
                    return False
                self._buf = rest
                self._strip_lead = False
            best: Optional[tuple[int, str, State]] = None
            for tag, nxt in watch:
                i = self._buf.find(tag)
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, tag, nxt)
            if best is not None:
                i, tag, nxt = best
                before = self._buf[:i]
                kept = before.rstrip()
                if kept:
                    out.append(piece(kept))
                self._buf = self._buf[i + len(tag) :]
                self._goto(nxt, tag)
                if nxt is State.CALL:
                    self._call = _Call(self._num_calls, before[len(kept) :])
                    return True
                self._strip_lead = True
                return True
            if final:
                text = self._buf.rstrip() if final_strip else self._buf
                if text:
                    out.append(piece(text))
                self._buf = ""
                return False
            if not watch:
                if self._buf:
                    out.append(piece(self._buf))
                self._buf = ""
                return False
            hold = _partial_suffix(self._buf, [t for t, _ in watch])
            safe = self._buf[: len(self._buf) - hold]
            kept = safe.rstrip()
            if kept:
                out.append(piece(kept))
            self._buf = self._buf[len(kept) :]
            return False

    # -- tool calls -----------------------------------------------------------------------
    def _scan_call(self, out: list, final: bool) -> bool:
        """Advance the call scanner over the buffer; True when the call ended."""
        call = self._call
        assert call is not None
        buf = self._buf
        close = self._call_close
        end_at: Optional[int] = None  # buffer index after the call's last character
        malformed = False
        while call.pos < len(buf) and end_at is None and not malformed:
            phase = call.phase
            c = buf[call.pos]
            if phase is _Phase.BROKEN:
                i = buf.find(close, call.pos)
                if i >= 0:
                    end_at = i + len(close)
                else:
                    call.pos = max(call.pos, len(buf) - len(close) + 1)
                    break
                continue
            if phase is _Phase.KEY or (phase is _Phase.VALUE and call.in_string):
                m = _STRING_STOP.search(buf, call.pos)
                if m is None:
                    call.pos = len(buf)
                    break
                if m.group(0) == "\\":
                    if m.start() + 1 >= len(buf):
                        call.pos = m.start()
                        break
                    call.pos = m.start() + 2
                    continue
                call.pos = m.start() + 1
                if phase is _Phase.KEY:
                    try:
                        call.key = json.loads(buf[call.key_start : call.pos])
                    except json.JSONDecodeError:
                        malformed = True
                        break
                    call.phase = _Phase.COLON
                else:
                    call.in_string = False
                    if call.value_kind == "string":
                        if not self._value_end(out, call, buf, call.pos):
                            malformed = True
                continue
            if phase is _Phase.VALUE and call.value_kind == "container":
                m = _CONTAINER_STOP.search(buf, call.pos)
                if m is None:
                    call.pos = len(buf)
                    break
                ch = m.group(0)
                call.pos = m.start()
                if ch == "<":
                    verdict = _close_at(buf, call.pos, close)
                    if verdict == "wait":
                        break
                    if verdict == "close":
                        end_at = call.pos + len(close)
                    else:
                        malformed = True
                    continue
                call.pos += 1
                if ch in "{[":
                    call.depth += 1
                elif ch in "}]":
                    call.depth -= 1
                    if call.depth == 0 and not self._value_end(out, call, buf, call.pos):
                        malformed = True
                else:  # '"'
                    call.in_string = True
                continue
            if phase is _Phase.VALUE:  # primitive: ends before a delimiter
                m = _PRIMITIVE_STOP.search(buf, call.pos)
                if m is None:
                    call.pos = len(buf)
                    break
                call.pos = m.start()
                if not self._value_end(out, call, buf, call.pos):
                    malformed = True
                continue
            # Structural phases, one character at a time.
            if c in _WS:
                call.pos += 1
                continue
            if c == "<":
                verdict = _close_at(buf, call.pos, close)
                if verdict == "wait":
                    break
                if verdict == "close":
                    end_at = call.pos + len(close)
                elif phase is _Phase.DONE:
                    end_at = call.pos  # the call is over; the rest is text again
                else:
                    malformed = True
                continue
            if phase is _Phase.OPEN:
                if c == "{":
                    call.phase = _Phase.KEY_OR_END
                    call.pos += 1
                else:
                    malformed = True
            elif phase is _Phase.KEY_OR_END:
                if c == '"':
                    call.phase = _Phase.KEY
                    call.key_start = call.pos
                    call.pos += 1
                elif c == "}":
                    call.phase = _Phase.DONE
                    call.pos += 1
                else:
                    malformed = True
            elif phase is _Phase.COLON:
                if c == ":":
                    call.phase = _Phase.VALUE_START
                    call.pos += 1
                else:
                    malformed = True
            elif phase is _Phase.VALUE_START:
                if c in "}],:":
                    malformed = True
                    continue
                call.value_start = call.pos
                call.phase = _Phase.VALUE
                if c in "{[":
                    call.value_kind, call.depth = "container", 1
                    call.pos += 1
                elif c == '"':
                    call.value_kind, call.in_string = "string", True
                    call.pos += 1
                else:
                    call.value_kind = "primitive"
                if call.key in ARGUMENT_KEYS and call.args_start is None:
                    call.args_start = call.value_start
                    call.args_kind = call.value_kind
                    call.args_sent = call.value_start
            elif phase is _Phase.AFTER:
                if c == ",":
                    call.phase = _Phase.KEY_OR_END
                    call.pos += 1
                elif c == "}":
                    call.phase = _Phase.DONE
                    call.pos += 1
                else:
                    malformed = True
            else:  # DONE: anything but whitespace or the close tag ends the call
                end_at = call.pos

        if malformed:
            if not call.committed:
                return self._as_text(out, call, upto=call.pos)
            self._stream_args(out, call, buf)  # up to the bad character, whatever the split
            call.phase = _Phase.BROKEN
            return self._scan_call(out, final)
        self._stream_args(out, call, buf)
        if end_at is None and not final:
            return False
        if end_at is None:
            end_at = len(buf)
        if not call.committed:
            return self._as_text(out, call, upto=end_at)
        self._end_call(out, call, buf)
        self._buf = buf[end_at:]
        self._call = None
        self._goto(State.TEXT, close)
        self._strip_lead = True
        return True

    def _value_end(self, out: list, call: _Call, buf: str, end: int) -> bool:
        """A value of the body's object is complete; False when it is malformed."""
        raw = buf[call.value_start : end]
        call.phase = _Phase.AFTER
        if call.key == "name" and call.name is None:
            try:
                name = json.loads(raw)
            except json.JSONDecodeError:
                return False
            if not isinstance(name, str):
                return False
            call.name = name
            if not call.committed:
                call.committed = True
                call.id = self._new_id()
                self._num_calls += 1
                out.append(ToolCallStart(call.index, call.id, name))
        elif call.value_start == call.args_start:
            call.args_end = end
            if call.args_kind == "string":
                try:
                    call.args_whole = json.loads(raw)
                except json.JSONDecodeError:
                    return False
            elif call.args_kind == "primitive":
                if raw == "null":
                    call.args_whole = "{}"
                else:
                    try:
                        json.loads(raw)
                    except json.JSONDecodeError:
                        return False
                    call.args_whole = raw
        return True

    def _stream_args(self, out: list, call: _Call, buf: str) -> None:
        """Send the argument text scanned so far (once committed)."""
        if not call.committed or call.args_start is None or call.phase is _Phase.BROKEN:
            return
        if call.args_kind == "container":
            upto = call.args_end if call.args_end is not None else call.pos
            if upto > call.args_sent:
                delta = buf[call.args_sent : upto]
                call.args_sent = upto
                call.args_text.append(delta)
                out.append(ToolCallArgs(call.index, delta, call.id))
        elif call.args_whole is not None and not call.args_text:
            call.args_text.append(call.args_whole)
            out.append(ToolCallArgs(call.index, call.args_whole, call.id))

    def _end_call(self, out: list, call: _Call, buf: str) -> None:
        if call.phase is not _Phase.BROKEN:
            self._stream_args(out, call, buf)
        if call.args_start is None:
            call.args_text.append("{}")
            out.append(ToolCallArgs(call.index, "{}", call.id))
        arguments = "".join(call.args_text)
        try:
            valid = isinstance(json.loads(arguments), dict)
        except json.JSONDecodeError:
            valid = False
        out.append(ToolCallEnd(call.index, arguments, valid, call.id))

    def _as_text(self, out: list, call: _Call, upto: int) -> bool:
        """An uncommitted call that turned out not to be one: its text, as written."""
        out.append(Text(call.ws_before + self._call_open + self._buf[:upto]))
        self._buf = self._buf[upto:]
        self._call = None
        # Not a real CALL -> TEXT transition (no closing tag was read): back to text.
        self._state = State.TEXT
        return True


# -- helpers ----------------------------------------------------------------------------------
def _partial_suffix(text: str, tags: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def _close_at(buf: str, pos: int, close: str) -> str:
    """'close' if the closing tag starts at pos, 'wait' if it may, else 'no'."""
    rest = buf[pos : pos + len(close)]
    if rest == close:
        return "close"
    if close.startswith(rest):
        return "wait"
    return "no"


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text / reasoning / same-call argument pieces joined."""
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if last is not None and last.kind == p.kind and p.kind in ("text", "reasoning", "tool_args") \
                and last.index == p.index:
            out[-1] = dataclasses.replace(last, text=last.text + p.text)
            continue
        out.append(p)
    return out

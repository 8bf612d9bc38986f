"""The pieces of parsed model output: what text/parsers.py emits, api/generation.py yields
and the api writers read. One frozen type; the kind says which fields mean something."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

PIECE_KINDS = ("text", "reasoning", "tool_start", "tool_args", "tool_end")


@dataclass(frozen=True)
class TokenChoice:
    """One token as logprobs report it: its text (bytes that complete no character as
    \\xNN), its raw bytes (token_bytes.TokenBytes) and its log probability."""

    token: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token and the top alternatives at its position (best first)."""

    chosen: TokenChoice
    top: tuple[TokenChoice, ...] = ()


@dataclass(frozen=True)
class Piece:
    """One parsed stretch of output; what api/generation.py yields and the api writers read.

    kind        text                    index  id       name   valid
    text        the text delta          0      ""       ""     True
    reasoning   the reasoning delta     0      ""       ""     True
    tool_start  ""                      call   call id  name   True
    tool_args   JSON-text delta         call   call id  ""     True
    tool_end    the whole arguments     call   call id  ""     they parse as an object
    """

    kind: str  # one of PIECE_KINDS
    text: str = ""
    index: int = 0  # the call's number within this output (tool_* kinds)
    id: str = ""  # the call's id (tool_* kinds)
    name: str = ""  # tool_start: the function name
    valid: bool = True  # tool_end: the arguments parse as a JSON object
    # the tokens whose text this piece completes, when the request asked for logprobs
    # (api/generation.py attaches them; a token's logprobs go out with its text)
    logprobs: tuple[TokenLogprobs, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in PIECE_KINDS:
            raise ValueError(f"unknown piece kind {self.kind!r}")


# Constructors of the five kinds, named for what they are.
def Text(text: str) -> Piece:  # noqa: N802 - a piece constructor, read like a type
    return Piece("text", text)


def Reasoning(text: str) -> Piece:  # noqa: N802
    return Piece("reasoning", text)


def ToolCallStart(index: int, id: str, name: str) -> Piece:  # noqa: N802
    return Piece("tool_start", index=index, id=id, name=name)


def ToolCallArgs(index: int, text: str, id: str) -> Piece:  # noqa: N802
    return Piece("tool_args", text, index=index, id=id)


def ToolCallEnd(index: int, arguments: str, valid: bool, id: str) -> Piece:  # noqa: N802
    return Piece("tool_end", arguments, index=index, id=id, valid=valid)


_ID_HEX_CHARS = 24


def new_call_id(prefix: str = "call_") -> str:
    """A tool-call id: the route's prefix (call_ / toolu_ / fc_) and 24 hex characters."""
    return prefix + secrets.token_hex(_ID_HEX_CHARS // 2)

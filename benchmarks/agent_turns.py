"""Agent first turns against a running server: Claude Code, Codex and Pi requests of the
measured shapes and sizes (tests/api/agent_requests.py), streamed as the clients stream
them, timed as their watchdogs see them.

Start the server yourself, e.g. `python -m mashbox run --ctx 32768 --rope-scaling yarn
--alias mashbox-model`, then:

    python benchmarks/agent_turns.py [--base-url http://127.0.0.1:8000] [--only claude_code,codex]
                                     [--max-tokens N] [--show-text] [--billing X]

Output: one line per request,

    NAME  prompt <n> tok (cached <n>)  first frame <s>  first content <s>  done <s>  out <n> tok
          <terminal event> stop <reason>  load <before> -> <1/5/15 min after>

`--max-tokens` caps each request's own output limit (max_tokens / max_output_tokens /
max_completion_tokens; default: the client's own, which the server clamps to the rest of
the context, so a looping model writes until the context is full). `--billing` changes
Claude Code's billing header (the first system block) as each real turn does; the header
is not in the prompt, so a rerun against the same server is served from the prefix
cache: restart the server to time a cold prefill.
"""
from __future__ import annotations

import argparse
import os
import sys

# benchmarks/http.py would shadow the standard library's http (httpx imports it): keep this
# folder off sys.path; the request builders live beside the tests that use them.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests", "api"))

import agent_requests as reqs  # noqa: E402
from agent_stream import read_turn  # noqa: E402

LIMIT_FIELD = {"claude_code": "max_tokens", "codex": "max_output_tokens", "pi_chat": "max_completion_tokens",
               "pi_messages": "max_tokens", "pi_responses": "max_output_tokens"}


def requests(billing: str) -> dict:
    return {
        "claude_code": ("messages", reqs.claude_code_body(billing), reqs.CLAUDE_HEADERS),
        "codex": ("responses", reqs.codex_body(), reqs.CODEX_HEADERS),
        "pi_chat": ("chat", reqs.pi_chat_body(), reqs.PI_HEADERS),
        "pi_messages": ("messages", reqs.pi_messages_body(), reqs.PI_ANTHROPIC_HEADERS),
        "pi_responses": ("responses", reqs.pi_responses_body(), reqs.PI_HEADERS),
    }


def prompt_tokens(usage: dict) -> tuple[int, int]:
    """(prompt tokens, of which cached) from any route's usage object."""
    if "cache_read_input_tokens" in usage:  # Messages: input_tokens excludes the cached ones
        cached = usage.get("cache_read_input_tokens") or 0
        return (usage.get("input_tokens") or 0) + cached, cached
    details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
    return usage.get("input_tokens", usage.get("prompt_tokens", 0)), details.get("cached_tokens", 0)


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(LIMIT_FIELD))
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--billing", default="bench1")
    ap.add_argument("--show-text", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args()
    todo = requests(args.billing)
    names = [n for n in args.only.split(",") if n] or list(todo)
    for name in names:
        wire, body, headers = todo[name]
        if args.max_tokens is not None:
            body[LIMIT_FIELD[name]] = args.max_tokens
        load0 = os.getloadavg()
        turn = read_turn(args.base_url, wire, body, headers, timeout=args.timeout)
        load = os.getloadavg()
        if turn.status != 200:
            print(f"{name:13s} HTTP {turn.status}: {turn.error_body[:300]!r}")
            continue
        n_prompt, n_cached = prompt_tokens(turn.usage)
        n_out = turn.usage.get("output_tokens", turn.usage.get("completion_tokens", 0))
        print(f"{name:13s} prompt {n_prompt} tok (cached {n_cached})  first frame {fmt(turn.first_frame_s)}  "
              f"first content {fmt(turn.first_content_s)}  done {fmt(turn.done_s)}  out {n_out} tok  "
              f"{turn.terminal} stop {turn.stop}  load {load0[0]:.1f} -> {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}",
              flush=True)
        if args.show_text:
            print("  text: " + repr(turn.text[:4000]) + (" ..." if len(turn.text) > 4000 else ""), flush=True)


if __name__ == "__main__":
    main()

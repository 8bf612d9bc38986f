"""Request bodies of the shape and size real coding agents send (../shared/spec/clients.md),
built programmatically from fixed seeds, so a test or a benchmark can replay an agent's
first turn without a literal 76 KB file.

- `claude_code_body(billing)`: Claude Code 2.1's first `POST /v1/messages?beta=true`
  as measured in issue 14: 24 tools with ~64.5 KB of tool JSON (draft 2020-12 schemas,
  `additionalProperties: false`, no `type`), 2 system blocks of ~6 KB in all (the first
  a billing header that changes every turn), 2 messages of ~6.7 KB (a user message with
  `<system-reminder>` blocks and `cache_control`, and a mid-conversation `system`
  message), `max_tokens` 32000, adaptive thinking, context_management, output_config,
  metadata: ~76 KB in all, ~20k prompt tokens on the default model. `scale` multiplies
  the tool text (0.5 -> ~12k tokens, 1.5 -> ~28.6k; the schemas are a floor of ~8k) for
  prefill benchmarks.
- `codex_body()`: Codex CLI 0.171's first `POST /v1/responses`: long `instructions`,
  function tools with `strict`, a `namespace` tool, `web_search`, a `custom`
  apply_patch tool, developer + user `input_text` messages: ~9.4k prompt tokens.
- `pi_chat_body()`, `pi_messages_body()`, `pi_responses_body()`: Pi 0.73 on each wire
  API, with its small system prompt and four tools (~1.5k tokens).
- `*_HEADERS`: the headers each client sends.

The prose is generated from small phrase tables with `random.Random(seed)`: varied
enough to tokenize like real instructions (not one sentence repeated), the same bytes on
every run. Sizes are of compact JSON (`json.dumps(..., separators=(",", ":"))`), as the
clients send it.
"""
from __future__ import annotations

import json
import random

CLAUDE_CODE_MODEL = "claude-sonnet-4-5-20250929"
CLAUDE_CODE_TOOL_BYTES = 64_500
CLAUDE_CODE_SYSTEM_BYTES = 6_000
CLAUDE_CODE_MESSAGE_BYTES = 6_700
CLAUDE_CODE_MAX_TOKENS = 32_000
CODEX_INSTRUCTIONS_BYTES = 21_000
CODEX_INPUT_BYTES = 7_000

# The question the agent prompts end with: one the model can answer from the prompt alone
# (the project notes in the reminder say what the project is), so a coherent model ends
# its turn after a sentence or two.
USER_ASK = "In one or two sentences, what does this project do? Do not use any tools."

CLAUDE_HEADERS = {
    "x-api-key": "sk-ant-unused", "anthropic-version": "2023-06-01",
    "anthropic-beta": ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
                       "prompt-caching-scope-2026-01-05,mid-conversation-system-2026-02-01,effort-2025-11-24,"
                       "fine-grained-tool-streaming-2025-05-14"),
    "anthropic-dangerous-direct-browser-access": "true", "x-app": "cli", "user-agent": "claude-cli/2.1.30 (external, cli)",
    "X-Claude-Code-Session-Id": "7f0c2a4e-5b1d-4c8e-9a37-2d6f1e0b8c55",
    "Accept-Encoding": "gzip, deflate, br, zstd",
}
CODEX_HEADERS = {
    "authorization": "Bearer unused", "originator": "codex_cli_rs", "user-agent": "codex_cli_rs/0.171.0",
    "session_id": "019ad3c1-7e42-7b10-9c55-4e8f2a6d1b03", "x-codex-window-id": "1",
    "x-codex-beta-features": "unified_exec,streamable_shell",
    "x-codex-turn-metadata": '{"turn_id":"019ad3c1-8000","sandbox":"workspace-write"}',
}
PI_HEADERS = {"authorization": "Bearer unused", "user-agent": "pi/0.73.0"}
PI_ANTHROPIC_HEADERS = {"x-api-key": "unused", "anthropic-version": "2023-06-01",
                        "anthropic-beta": "interleaved-thinking-2025-05-14", "user-agent": "pi/0.73.0"}

# --- prose ------------------------------------------------------------------------------

_OPEN = ["When", "Before", "After", "Whenever", "If", "As soon as", "Only when", "Each time"]
_SUBJECT = ["you need to", "the user asks you to", "a task requires you to", "you are about to",
            "the request makes it necessary to", "you have been asked to"]
_ACTION = ["read", "search", "modify", "inspect", "rename", "create", "delete", "run", "verify", "summarize",
           "compare", "refactor", "document", "test", "format", "review"]
_OBJECT = ["a file in the working directory", "several related modules", "the project's configuration",
           "a test that failed", "the output of a command", "code that other files import",
           "a long log file", "the dependency list", "a directory tree", "generated artifacts",
           "a function's call sites", "the git history", "a notebook cell", "the build scripts"]
_DIRECTIVE = ["always prefer", "make sure to use", "you should call", "do not hesitate to use",
              "it is best to rely on", "remember to use", "first try"]
_MANNER = ["with an absolute path", "with the smallest scope that works", "before making any change",
           "and check the result carefully", "instead of guessing", "in a single call where possible",
           "and report what you found", "rather than a shell command", "and keep the output short",
           "with parameters that match the schema exactly"]
_NOTE = ["This tool is read-only and safe to call in parallel.",
         "Results are truncated when they are longer than the limit.",
         "The working directory persists between calls.",
         "Never include secrets or credentials in the arguments.",
         "Paths must be absolute, not relative.",
         "Prefer batching independent calls into one message.",
         "The tool fails if the target was not read first in this conversation.",
         "Large outputs are saved to a file and a summary is returned instead.",
         "Quote paths that contain spaces.",
         "The call times out after two minutes unless a longer timeout is given.",
         "Use this proactively for multi-step tasks.",
         "It returns matching lines sorted by modification time."]
EXAMPLE_SHARE = 0.25  # of bullet lines: what brings the prompt to the measured tokens per byte
_WORDS = ["project", "module", "request", "session", "context", "output", "pattern", "change", "result", "option",
          "default", "limit", "value", "format", "command", "file", "directory", "remote", "commit", "test"]


def _sentence(rng: random.Random, tool: str) -> str:
    s = (f"{rng.choice(_OPEN)} {rng.choice(_SUBJECT)} {rng.choice(_ACTION)} {rng.choice(_OBJECT)}, "
         f"{rng.choice(_DIRECTIVE)} {tool} {rng.choice(_MANNER)}.")
    if rng.random() < 0.3:
        s += " " + rng.choice(_NOTE)
    return s


_EXT = ["py", "ts", "rs", "go", "json", "toml", "md", "c", "h", "yaml"]
_CMD = ["git log --oneline -n {n} -- {path}", "rg -n \"{w}_{v}\" --glob '*.{ext}' {dir}", "ls -la {dir}",
        "python -m pytest -q {path}::test_{w}_{v} -x", "npm run {w}:{v} -- --watch={n}",
        "sed -n {n},{m}p {path}", "git diff --stat HEAD~{n} -- {dir}", "cargo test {w}::{v} -- --nocapture"]


def _example(rng: random.Random, tool: str) -> str:
    """A line of the code-like kind real tool manuals are full of (paths, flags, calls):
    it tokenizes denser than prose, as the real ones do."""
    w, v = rng.choice(_WORDS), rng.choice(_WORDS)
    d = f"src/{rng.choice(_WORDS)}_{rng.choice(_WORDS)}"
    path = f"{d}/{w}_{v}.{rng.choice(_EXT)}"
    cmd = rng.choice(_CMD).format(n=rng.randint(2, 400), m=rng.randint(400, 900), path=path, dir=d, w=w, v=v,
                                  ext=rng.choice(_EXT))
    if rng.random() < 0.5:
        return f"- e.g. `{cmd}`"
    return (f'<example>user: {rng.choice(_ACTION)} {path}\nassistant: {tool}({{"{v}": "{path}", '
            f'"{w}": {rng.randint(1, 99)}}}) -> `{cmd}`</example>')


def _lines(rng: random.Random, tool: str, bullets: bool = True):
    """Endless sentences (as '- ' bullets under an occasional heading, with examples, when
    `bullets`)."""
    while True:
        if bullets and rng.random() < EXAMPLE_SHARE:
            yield _example(rng, tool) + "\n"
        elif bullets and rng.random() < 0.08:
            yield f"\n## {rng.choice(_WORDS).capitalize()} {rng.choice(_WORDS)}s\n"
        elif bullets:
            yield "- " + _sentence(rng, tool) + "\n"
        else:
            yield _sentence(rng, tool) + " "


def _prose(rng: random.Random, tool: str, n_bytes: int, bullets: bool = True) -> str:
    """Sentences until about n_bytes of UTF-8."""
    parts: list[str] = []
    size = 0
    for line in _lines(rng, tool, bullets):
        if size >= n_bytes:
            break
        parts.append(line)
        size += len(line.encode())
    return "".join(parts).strip()


def compact(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


# --- Claude Code --------------------------------------------------------------------------

# (name, one-line purpose, parameters: name -> (JSON type, required)); the first 24 of
# Claude Code 2.1's tool list.
CLAUDE_CODE_TOOLS = [
    ("Task", "Launch a new agent to handle complex, multi-step tasks autonomously.",
     {"description": ("string", True), "prompt": ("string", True), "subagent_type": ("string", True),
      "model": ("enum", False), "resume": ("string", False)}),
    ("Bash", "Executes a given bash command in a persistent shell session with optional timeout.",
     {"command": ("string", True), "timeout": ("number", False), "description": ("string", False),
      "run_in_background": ("boolean", False), "dangerouslyDisableSandbox": ("boolean", False)}),
    ("Glob", "Fast file pattern matching tool that works with any codebase size.",
     {"pattern": ("string", True), "path": ("string", False)}),
    ("Grep", "A powerful search tool built on ripgrep.",
     {"pattern": ("string", True), "path": ("string", False), "glob": ("string", False),
      "output_mode": ("enum", False), "-B": ("number", False), "-A": ("number", False), "-C": ("number", False),
      "-n": ("boolean", False), "-i": ("boolean", False), "type": ("string", False), "head_limit": ("number", False),
      "multiline": ("boolean", False)}),
    ("ExitPlanMode", "Use this tool when you are in plan mode and have finished presenting your plan.",
     {"plan": ("string", True)}),
    ("Read", "Reads a file from the local filesystem.",
     {"file_path": ("string", True), "offset": ("number", False), "limit": ("number", False)}),
    ("Edit", "Performs exact string replacements in files.",
     {"file_path": ("string", True), "old_string": ("string", True), "new_string": ("string", True),
      "replace_all": ("boolean", False)}),
    ("Write", "Writes a file to the local filesystem.",
     {"file_path": ("string", True), "content": ("string", True)}),
    ("NotebookEdit", "Completely replaces the contents of a specific cell in a Jupyter notebook.",
     {"notebook_path": ("string", True), "cell_id": ("string", False), "new_source": ("string", True),
      "cell_type": ("enum", False), "edit_mode": ("enum", False)}),
    ("WebFetch", "Fetches content from a specified URL and processes it using an AI model.",
     {"url": ("string", True), "prompt": ("string", True)}),
    ("TodoWrite", "Use this tool to create and manage a structured task list for your current coding session.",
     {"todos": ("array", True)}),
    ("WebSearch", "Allows Claude to search the web and use the results to inform responses.",
     {"query": ("string", True), "allowed_domains": ("strings", False), "blocked_domains": ("strings", False)}),
    ("BashOutput", "Retrieves output from a running or completed background bash shell.",
     {"bash_id": ("string", True), "filter": ("string", False)}),
    ("KillShell", "Kills a running background bash shell by its ID.", {"shell_id": ("string", True)}),
    ("AskUserQuestion", "Use this tool when you need to ask the user questions during execution.",
     {"questions": ("array", True), "answers": ("object", False)}),
    ("Skill", "Execute a skill within the main conversation.", {"skill": ("string", True)}),
    ("SlashCommand", "Execute a slash command within the main conversation.", {"command": ("string", True)}),
    ("EnterPlanMode", "Use this tool to enter plan mode before a non-trivial implementation task.", {}),
    ("MultiEdit", "Makes multiple edits to a single file in one operation.",
     {"file_path": ("string", True), "edits": ("array", True)}),
    ("LS", "Lists files and directories in a given path.", {"path": ("string", True), "ignore": ("strings", False)}),
    ("ListMcpResourcesTool", "Lists available resources from configured MCP servers.", {"server": ("string", False)}),
    ("ReadMcpResourceTool", "Reads a specific resource from an MCP server.",
     {"server": ("string", True), "uri": ("string", True)}),
    ("mcp__ide__getDiagnostics", "Get language diagnostics from VS Code.", {"uri": ("string", False)}),
    ("mcp__ide__executeCode", "Execute python code in the Jupyter kernel for the current notebook file.",
     {"code": ("string", True)}),
]

# How the tool text splits over the tools (Bash, Task and TodoWrite carry the long manuals).
_TOOL_WEIGHT = {"Bash": 6.0, "Task": 4.0, "TodoWrite": 4.0, "Grep": 2.0, "Edit": 1.5, "Read": 1.5, "Write": 1.2,
                "AskUserQuestion": 1.5, "ExitPlanMode": 1.5, "EnterPlanMode": 1.5, "WebFetch": 1.2, "WebSearch": 1.0}


def _param_schema(rng: random.Random, tool: str, name: str, kind: str) -> dict:
    desc = _sentence(rng, tool)
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["content", "files_with_matches", "count", "sonnet", "opus",
                                                       "haiku", "code", "markdown", "replace", "insert"], 3),
                "description": desc}
    if kind == "strings":
        return {"type": "array", "items": {"type": "string"}, "description": desc}
    if kind == "array":
        return {"type": "array", "description": desc, "items": {
            "type": "object", "additionalProperties": False, "required": ["content", "status"],
            "properties": {"content": {"type": "string", "minLength": 1},
                           "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                           "activeForm": {"type": "string", "minLength": 1}}}}
    if kind == "object":
        return {"type": "object", "additionalProperties": {"type": "string"}, "description": desc}
    return {"type": kind, "description": desc}


def _claude_tool(rng: random.Random, name: str, purpose: str, params: dict) -> dict:
    schema = {"type": "object",
              "properties": {p: _param_schema(rng, name, p, kind) for p, (kind, _) in params.items()},
              "required": [p for p, (_, req) in params.items() if req],
              "additionalProperties": False, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    return {"name": name, "description": purpose + "\n\nUsage:", "input_schema": schema}


def _grow(rng: random.Random, tool: dict, n_bytes: int) -> None:
    """Add description lines while the tool's compact JSON stays within n_bytes (JSON
    escapes newlines, so the text's own length would undercount)."""
    misses = 0
    for line in _lines(rng, tool["name"]):
        before = tool["description"]
        tool["description"] += "\n" + line.rstrip("\n")
        if len(compact(tool).encode()) > n_bytes:
            tool["description"] = before
            misses += 1  # a shorter line may still fit
            if misses == 20:
                break


def claude_code_tools(scale: float = 1.0, seed: int = 14) -> list[dict]:
    rng = random.Random(seed)
    tools = [_claude_tool(rng, name, purpose, params) for name, purpose, params in CLAUDE_CODE_TOOLS]
    weights = [_TOOL_WEIGHT.get(t["name"], 0.5) for t in tools]
    # The schemas are the floor; the rest of the tool bytes go to the descriptions by weight.
    room = CLAUDE_CODE_TOOL_BYTES * scale - len(compact(tools).encode())
    for tool, w in zip(tools, weights):
        _grow(rng, tool, len(compact(tool).encode()) + int(room * w / sum(weights)))
    return tools


PROJECT_NOTES = """# CLAUDE.md

This repository is mashbox, a local LLM inference server written in Python. It serves a
language model over HTTP with the OpenAI Chat Completions, Completions and Responses APIs
and the Anthropic Messages API, so coding agents such as Claude Code, Codex and Pi can
run against a model on the user's own machine. The scheduler is pure Python; a worker
process runs the forward pass with torch and a small C extension.

## Commands
- `python -m mashbox run` starts the server on 127.0.0.1:8000.
- `python -m pytest -q -m "not slow"` runs the fast tests.
"""


def claude_code_body(billing: str = "a1b2c", scale: float = 1.0, seed: int = 14,
                     max_tokens: int = CLAUDE_CODE_MAX_TOKENS) -> dict:
    rng = random.Random(seed + 1)
    header = f"x-anthropic-billing-header: cc_version=2.1.30.{billing}; cc_entrypoint=cli; cch={billing};"
    intro = ("You are Claude Code, Anthropic's official CLI for Claude.\n"
             "You are an interactive CLI tool that helps users with software engineering tasks. "
             "Use the instructions below and the tools available to you to assist the user.\n\n")
    system_room = CLAUDE_CODE_SYSTEM_BYTES - len(header) - len(intro)
    system = [
        {"type": "text", "text": header},
        {"type": "text", "text": intro + _prose(rng, "the right tool", system_room),
         "cache_control": {"type": "ephemeral"}},
    ]
    env = ("<env>\nWorking directory: /home/user/mashbox\nIs directory a git repo: Yes\nPlatform: linux\n"
           "Today's date: 2026-12-01\n</env>\n")
    reminder_room = CLAUDE_CODE_MESSAGE_BYTES - len(PROJECT_NOTES) - len(env) - len(USER_ASK) - 650
    reminder = ("<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
                "# claudeMd\nCodebase and user instructions are shown below.\n\n" + PROJECT_NOTES + "\n" + env +
                "# Conventions\n" + _prose(rng, "the tools", reminder_room) +
                "\n\nIMPORTANT: this context may or may not be relevant to your tasks.\n</system-reminder>")
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": reminder},
            {"type": "text", "text": USER_ASK, "cache_control": {"type": "ephemeral"}},
        ]},
        {"role": "system", "content": "<system-reminder>The task tools are available; the todo list is empty. "
                                      "Do not mention this reminder to the user.</system-reminder>"},
    ]
    return {
        "model": CLAUDE_CODE_MODEL,
        "messages": messages,
        "system": system,
        "tools": claude_code_tools(scale, seed),
        "metadata": {"user_id": "user_5e1c0d2f_account_8a4b_session_7f0c2a4e-5b1d-4c8e-9a37-2d6f1e0b8c55"},
        "max_tokens": max_tokens,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


# --- Codex ----------------------------------------------------------------------------------

CODEX_FUNCTIONS = [
    ("shell", "Runs a shell command and returns its output.",
     {"command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"},
      "timeout_ms": {"type": "number"}}, ["command"]),
    ("update_plan", "Updates the task plan.",
     {"explanation": {"type": "string"},
      "plan": {"type": "array", "items": {"type": "object", "properties": {
          "step": {"type": "string"}, "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}},
          "required": ["step", "status"], "additionalProperties": False}}}, ["plan"]),
    ("view_image", "Attach a local image (by filesystem path) to the conversation context for this turn.",
     {"path": {"type": "string"}}, ["path"]),
    ("list_mcp_resources", "Lists resources provided by MCP servers.",
     {"server": {"type": "string"}, "cursor": {"type": "string"}}, []),
]


def codex_tools(seed: int = 15) -> list[dict]:
    rng = random.Random(seed)
    tools: list[dict] = []
    for name, purpose, props, required in CODEX_FUNCTIONS:
        props = {k: {**v, "description": _sentence(rng, name)} for k, v in props.items()}
        tools.append({"type": "function", "name": name, "description": purpose + " " + _prose(rng, name, 500, False),
                      "strict": False, "parameters": {"type": "object", "properties": props, "required": required,
                                                      "additionalProperties": False}})
    tools.append({"type": "namespace", "name": "mcp__docs__", "description": "Project documentation server.",
                  "tools": [{"type": "function", "name": n, "description": _prose(rng, n, 300, False),
                             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
                            for n in ("search", "fetch_page")]})
    tools.append({"type": "web_search", "external_web_access": False})
    tools.append({"type": "custom", "name": "apply_patch",
                  "description": "Use the `apply_patch` tool to edit files. " + _prose(rng, "apply_patch", 600, False),
                  "format": {"type": "grammar", "syntax": "lark",
                             "definition": "start: begin_patch hunk+ end_patch\nbegin_patch: \"*** Begin Patch\" LF\n"
                                           "end_patch: \"*** End Patch\" LF?\nhunk: add_hunk | delete_hunk | update_hunk\n"
                                           "%import common.LF"}})
    return tools


def codex_body(seed: int = 15) -> dict:
    rng = random.Random(seed + 1)
    instructions = ("You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI on a user's "
                    "computer.\n\n# General\n" + _prose(rng, "the shell tool", CODEX_INSTRUCTIONS_BYTES))
    permissions = ("<permissions instructions>\nFilesystem sandboxing defines which files can be read or written. "
                   "`sandbox_mode` is `workspace-write`. Network access is restricted. Approval policy is "
                   "`on-request`.\n" + _prose(rng, "the shell tool", 1500) + "\n</permissions instructions>")
    agents = ("# AGENTS.md instructions for /home/user/mashbox\n\n<INSTRUCTIONS>\n" + PROJECT_NOTES +
              _prose(rng, "the shell tool", CODEX_INPUT_BYTES - 2000 - len(PROJECT_NOTES)) + "\n</INSTRUCTIONS>")
    env = ("<environment_context>\n  <cwd>/home/user/mashbox</cwd>\n  <approval_policy>on-request</approval_policy>\n"
           "  <sandbox_mode>workspace-write</sandbox_mode>\n  <network_access>restricted</network_access>\n"
           "  <shell>bash</shell>\n</environment_context>")
    return {
        "model": "mashbox-model",
        "instructions": instructions,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": permissions}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": agents},
                                                            {"type": "input_text", "text": env}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER_ASK}]},
        ],
        "tools": codex_tools(seed),
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto", "effort": "medium"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019ad3c1-7e42-7b10-9c55-4e8f2a6d1b03",
        "client_metadata": {"originator": "codex_cli_rs", "turn": "1"},
    }


# --- Pi -------------------------------------------------------------------------------------

PI_MAX_TOKENS = 16_384
PI_TOOLS = [
    ("read", "Read the contents of a file. Supports text files and images.",
     {"path": {"type": "string"}, "offset": {"type": "number"}, "limit": {"type": "number"}}, ["path"]),
    ("bash", "Execute a bash command in the current working directory.",
     {"command": {"type": "string"}, "timeout": {"type": "number"}}, ["command"]),
    ("edit", "Edit a file by replacing exact text.",
     {"path": {"type": "string"}, "oldText": {"type": "string"}, "newText": {"type": "string"}},
     ["path", "oldText", "newText"]),
    ("write", "Write content to a file, creating it if needed.",
     {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
]


def pi_system(seed: int = 16) -> str:
    rng = random.Random(seed)
    return ("You are an expert coding assistant. You help users with coding tasks by reading files, executing "
            "commands, editing code, and writing new files.\n\nGuidelines:\n" + _prose(rng, "the read tool", 2500) +
            "\n\n" + PROJECT_NOTES + "\nCurrent working directory: /home/user/mashbox")


def _pi_schema(props: dict, required: list) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def pi_chat_body() -> dict:
    return {
        "model": "mashbox-model",
        "messages": [{"role": "developer", "content": pi_system()},
                     {"role": "user", "content": [{"type": "text", "text": USER_ASK}]}],
        "tools": [{"type": "function", "function": {"name": n, "description": d, "parameters": _pi_schema(p, r),
                                                    "strict": False}} for n, d, p, r in PI_TOOLS],
        "max_completion_tokens": PI_MAX_TOKENS,
        "reasoning_effort": "medium",
        "store": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def pi_messages_body() -> dict:
    tools = [{"name": n, "description": d, "input_schema": _pi_schema(p, r), "eager_input_streaming": True}
             for n, d, p, r in PI_TOOLS]
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    return {
        "model": "mashbox-model",
        "system": [{"type": "text", "text": pi_system(), "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": USER_ASK,
                                                   "cache_control": {"type": "ephemeral"}}]}],
        "tools": tools,
        "max_tokens": PI_MAX_TOKENS,
        "thinking": {"type": "enabled", "budget_tokens": 8192, "display": "summarized"},
        "stream": True,
    }


def pi_responses_body() -> dict:
    return {
        "model": "mashbox-model",
        "input": [{"role": "developer", "content": pi_system()},
                  {"role": "user", "content": [{"type": "input_text", "text": USER_ASK}]}],
        "tools": [{"type": "function", "name": n, "description": d, "parameters": _pi_schema(p, r), "strict": False}
                  for n, d, p, r in PI_TOOLS],
        "max_output_tokens": PI_MAX_TOKENS,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "pi-session-1",
        "store": False,
        "stream": True,
    }


def sizes(body: dict) -> dict:
    """Compact-JSON bytes of a body and of its parts (what the measured sizes count)."""
    out = {"total": len(compact(body).encode())}
    for key in ("tools", "system", "messages", "instructions", "input"):
        if key in body:
            out[key] = len(compact(body[key]).encode())
    return out


if __name__ == "__main__":
    for name, body in [("claude_code", claude_code_body()), ("codex", codex_body()), ("pi_chat", pi_chat_body()),
                       ("pi_messages", pi_messages_body()), ("pi_responses", pi_responses_body())]:
        print(name, sizes(body), len(body.get("tools", [])), "tools")

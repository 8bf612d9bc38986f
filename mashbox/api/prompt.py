"""A conversation (any route's, mapped to one shape) -> the prompt ids the engine runs.

Rules:
- Routes map their request onto a `Conversation` of HF-style messages, the shape chat
  templates read:
    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": dict}}],
     "tool_call_id": str, "name": str, "reasoning_content": str}
  and HF-style tools `{"type": "function", "function": {"name", "description",
  "parameters"}}`.
- System text, one rule in one place (`place_system`): the system / developer messages
  before the first other message are joined (in order, blank line between, empty ones
  dropped) into one system message at the front, since templates expect at most one,
  first. A later one is placed by the API's own contract (`Conversation.later_system`):
  Chat's spec says system and developer messages join the system prompt, so there a
  later one joins it too ("join"); on Messages and Responses a later one is a note at
  that point of the conversation (Claude Code's mid-conversation system messages), kept
  where it stands as user text in <system-reminder> tags ("remind": added to the user
  message it follows, else a user message of its own), so the prompt's first tokens, and
  with them the prefix cache of a long conversation, do not change turn to turn.
  Converters leave system messages where the client put them; this is the only place
  that moves or rewrites them.
- tool_choice: none renders no tools and parses none; auto renders them; required and
  a named function also start the assistant turn with the opening of a call
  (`<tool_call>\n` / `<tool_call>\n{"name": "NAME", "arguments": `), so even a small
  model produces a call; required with one tool is that tool named. The opening is
  model output as far as the parser is concerned: generation.py feeds
  `Prompt.forced_text` to the parser first.
- Constrained output (text/grammar.py): a response format (`Conversation.output_format`)
  and the tool choice make the request's `Constraint`, checked here (compiled against the
  model's vocabulary) so a schema llguidance cannot compile is a 400 naming its field
  before anything is queued. A grammar not checked before is checked on the grammar
  thread (`settled`, awaited by the route), never on the event loop: /health and the
  other streams go on while a big tool set compiles. With tools in play: required / named -> only the call(s)
  after the forced opening: one call unless parallel_tool_calls is true (a small model
  forced to call repeats the call until max_tokens when it may); auto -> free
  text whose calls are bound to the tools (lazy), or, with a response format, either
  the formatted value or the call(s) (several unless parallel_tool_calls is false); none -> text that may not open a call. Without
  tools, the response format alone; for a model that reasons, after a thought (the
  think block the prompt opened, or an optional one).
- max_tokens: default = what is left of the context after the prompt; a larger request
  is clamped to it (agents ask for 64,000). A prompt that leaves no room for one new
  token is a 400 that says by how many tokens it is too long.
- A prompt far too long is refused before it is rendered or tokenized (that costs
  seconds for megabytes of text): no token covers more characters than the longest
  entry of the vocabulary, so text of C characters is at least
  C / (SHRINK * longest) tokens (SHRINK allows for a normalizer that composes
  characters); when that bound alone leaves no room in the context, the 400 says
  "at least" that many tokens. Only message / prompt text is counted (a template may
  drop earlier thoughts, never the messages' content).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Optional

from mashbox.api.common import ApiContext, bad_request
from mashbox.config import Constraint
from mashbox.text import grammar, tool_prompt

log = logging.getLogger("mashbox.api")

TOOL_CALL_OPEN = tool_prompt.CALL_OPEN
TOOL_CHOICE_MODES = ("auto", "none", "required", "named")


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # auto | none | required | named
    name: Optional[str] = None  # the function, when mode == "named"

    def __post_init__(self):
        if self.mode not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool choice mode {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("a named tool choice needs a name, and only it")


@dataclass(frozen=True)
class OutputFormat:
    """A response format: what the answer's text must be, and the request field it came from."""

    constraint: Constraint
    field: str  # e.g. response_format.json_schema.schema: the 400 of a bad schema names it


@dataclass(frozen=True)
class Conversation:
    messages: list  # HF-style dicts (see the module rules); system ones anywhere
    tools: list = field(default_factory=list)  # HF-style function tools
    tool_choice: ToolChoice = ToolChoice()
    enable_thinking: Optional[bool] = None  # None = the template's default
    later_system: str = "remind"  # a system message after the first turn: "join" | "remind"
    output_format: Optional[OutputFormat] = None  # structured output (module rules)
    parallel_tool_calls: Optional[bool] = None  # False: at most one call; None: unsaid (module rules)
    # (the name the model sees, a Lark grammar) of custom tools whose input must follow it
    tool_grammars: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Prompt:
    """What generation.py needs to run one request and parse its output."""

    ids: tuple[int, ...]
    max_tokens: int  # already fitted to the context
    forced_text: str = ""  # assistant text the prompt already ends with (forced call opening)
    parse_tools: bool = False
    parse_reasoning: bool = False
    starts_in_reasoning: bool = False  # the generation prompt opened a think block
    tool_names: tuple[str, ...] = ()
    constraint: Optional[Constraint] = None  # what the sampled text must match (module rules)
    pending: Optional["ConstraintPlan"] = None  # its candidates, while not yet checked (settled())


# ---------------------------------------------------------------------------------------
# Conversation shaping
# ---------------------------------------------------------------------------------------


SYSTEM_ROLES = ("system", "developer")
LATER_SYSTEM = ("join", "remind")


def place_system(messages: list, later: str = "remind") -> list:
    """Apply the system rule (module rules) to a conversation's messages; `later` is
    "join" or "remind" (what a system message after the first turn becomes)."""
    if later not in LATER_SYSTEM:
        raise ValueError(f"later system rule {later!r}")
    leading: list[str] = []
    out: list[dict] = []
    for m in messages:
        if m.get("role") not in SYSTEM_ROLES:
            out.append(m)
            continue
        text = m.get("content") or ""
        if not out or later == "join":
            if text:
                leading.append(text)
            continue
        note = f"<system-reminder>\n{text}\n</system-reminder>"
        last = out[-1]
        if last["role"] == "user":
            out[-1] = {**last, "content": f"{last['content']}\n\n{note}" if last["content"] else note}
        else:
            out.append({"role": "user", "content": note})
    if leading:
        return [{"role": "system", "content": "\n\n".join(leading)}] + out
    return out


def tool_names(tools: list) -> tuple[str, ...]:
    return tuple(t["function"]["name"] for t in tools)


def forced_opening(choice: ToolChoice, names: tuple[str, ...] = ()) -> str:
    """The start of the assistant turn that forces a call (empty for auto / none).

    required with a single tool forces that tool's name too: it is the only call that
    satisfies "required", and a small model left to write the name often writes
    something else (an argument value)."""
    if choice.mode == "required":
        return tool_prompt.forced_call_prefix(names[0] if len(names) == 1 else None)
    if choice.mode == "named":
        return tool_prompt.forced_call_prefix(choice.name)
    return ""


# ---------------------------------------------------------------------------------------
# Rendering and encoding (text.chat renders the template; this adds forcing and fitting)
# ---------------------------------------------------------------------------------------


def _template_kwargs(conv: Conversation) -> dict:
    kwargs = {}
    if conv.enable_thinking is not None:
        kwargs["enable_thinking"] = conv.enable_thinking
    return kwargs


def _build(api: ApiContext, messages: list, tools: Optional[list], conv: Conversation, prefix: str = ""):
    """text.chat.ChatPrompt of the conversation (ids, in_reasoning); template errors -> 400."""
    from mashbox.text.chat import TemplateError

    try:
        return api.template.build(messages, tools or None, True, prefix, **_template_kwargs(conv))
    except TemplateError as exc:
        raise bad_request(f"messages could not be rendered by the chat template: {exc}", "messages") from None


def _render(api: ApiContext, conv: Conversation) -> tuple[list[int], bool, str, bool]:
    """(ids, starts in reasoning, forced text, tools active) of a conversation.

    The forced opening goes through the template's build as plain text following the
    generation prompt (so it tokenizes as HF would tokenize the whole string), except
    when the model has `<tool_call>` as a special token (Qwen): the model writes that
    token, so the opening is that id followed by the rest as continuation text. The
    client's part (a tool name) is always plain text.
    """
    messages = place_system(conv.messages, conv.later_system)
    use_tools = bool(conv.tools) and conv.tool_choice.mode != "none"
    tools = conv.tools if use_tools else None
    forced = forced_opening(conv.tool_choice, tool_names(conv.tools)) if use_tools else ""
    special = api.tokenizer.special_tokens
    if forced and TOOL_CALL_OPEN in special:
        built = _build(api, messages, tools, conv)
        ids = list(built.ids) + api.tokenizer.encode_marked(
            [(TOOL_CALL_OPEN, True), (forced[len(TOOL_CALL_OPEN):], False)])
    else:
        built = _build(api, messages, tools, conv, forced)
        ids = list(built.ids)
    in_reasoning = bool(built.in_reasoning) and not forced
    return ids, in_reasoning, forced, use_tools


class PerTokenizer:
    """Values made once per tokenizer object and dropped with it. Keyed by identity (a
    Tokenizer is an unhashable dataclass) through a weak reference, so an id reused after
    the object is collected never finds the old entry."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, object]] = {}  # id -> (ref to the tokenizer, its value)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tokenizer, make):
        """The value of `tokenizer`, made by make(tokenizer) the first time."""
        key = id(tokenizer)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is tokenizer:
            return hit[1]
        value = make(tokenizer)
        self._entries[key] = (weakref.ref(tokenizer, lambda ref, key=key: self._forget(key, ref)), value)
        return value

    def _forget(self, key: int, ref: weakref.ref) -> None:
        hit = self._entries.get(key)
        if hit is not None and hit[0] is ref:
            del self._entries[key]


SHRINK = 4  # characters a normalizer may fold into one (NFC / NFKC compose at most ~3)
_LONGEST_TOKEN = PerTokenizer()  # tokenizer -> characters of its longest vocabulary entry


def _longest_token(tokenizer) -> int:
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=1) or 1


def longest_token_chars(tokenizer) -> int:
    return _LONGEST_TOKEN.get(tokenizer, _longest_token)


def conversation_chars(conv: Conversation) -> int:
    """Characters of the conversation's message content (what every template renders)."""
    return sum(len(m["content"]) for m in conv.messages if isinstance(m.get("content"), str))


def refuse_far_too_long(api: ApiContext, chars: int, param: str) -> None:
    """The cheap early 400 (module rules): no rendering, no tokenizing."""
    ctx = api.ctx
    at_least = chars // (SHRINK * longest_token_chars(api.tokenizer))
    if at_least >= ctx:
        raise bad_request(
            f"The prompt is at least {at_least} tokens, more than the context of {ctx} tokens "
            f"(which must also hold at least one new token); shorten it.",
            param,
        )


def fit_max_tokens(api: ApiContext, n_prompt: int, requested: Optional[int], param: str = "messages") -> int:
    ctx = api.ctx
    room = ctx - n_prompt
    if room < 1:
        over = n_prompt - ctx + 1
        raise bad_request(
            f"The prompt is {n_prompt} tokens, {over} too many for the context of {ctx} tokens "
            f"(which must also hold at least one new token); shorten it by {over} tokens.",
            param,
        )
    if requested is None or requested > room:
        return room
    return requested


# The grammar checks run on one thread of their own (GRAMMAR_THREAD), never on the event
# loop: llguidance drops the GIL while it compiles, so other connections go on. Its
# tokenizer holds the GIL while it is built (~0.3 s), so that happens at start-up
# (`warm_grammar`, app.serve_async), not at the first constrained request.
_LL_TOKENIZERS = PerTokenizer()  # tokenizer -> its llguidance tokenizer (the grammar check)
_LL_LOCK = threading.Lock()
_GRAMMAR_THREAD: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _grammar_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _GRAMMAR_THREAD
    with _LL_LOCK:
        if _GRAMMAR_THREAD is None:
            _GRAMMAR_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mashbox-grammar-check")
        return _GRAMMAR_THREAD


def _ll_tokenizer(tokenizer):
    with _LL_LOCK:
        return _LL_TOKENIZERS.get(tokenizer, grammar.ll_tokenizer)


def warm_grammar(tokenizer) -> concurrent.futures.Future:
    """Build the tokenizer's llguidance tokenizer on the grammar thread (server start-up)."""
    return _grammar_thread().submit(_ll_tokenizer, tokenizer)


_CHECKED: dict[str, Optional[str]] = {}  # grammar text -> check()'s answer (agents resend their tools)
CHECKED_MAX = 256


def _key(constraint: Constraint) -> str:
    return constraint.kind + "\0" + constraint.grammar


def _check(api: ApiContext, constraint: Constraint) -> Optional[str]:
    key = _key(constraint)
    if key not in _CHECKED:
        reason = grammar.check(constraint, _ll_tokenizer(api.tokenizer))
        if len(_CHECKED) >= CHECKED_MAX:
            _CHECKED.pop(next(iter(_CHECKED)), None)
        _CHECKED[key] = reason
    return _CHECKED[key]


@dataclass(frozen=True)
class Candidate:
    """One possible constraint of a request, not yet checked."""

    constraint: Optional[Constraint]
    field: Optional[str]  # a failure is a 400 naming it; None: logged, the next candidate is tried
    error: Optional[str] = None  # known to fail already (the grammar could not even be written)


@dataclass(frozen=True)
class ConstraintPlan:
    """A request's constraint candidates in order: the first that compiles is its constraint."""

    candidates: tuple[Candidate, ...]

    def settle(self, check) -> Optional[Constraint]:
        """check(constraint) -> None or why it does not compile; a 400 for a failing
        candidate with a field (module rules)."""
        for cand in self.candidates:
            reason = cand.error if cand.error is not None else check(cand.constraint)
            if reason is None:
                return cand.constraint
            if cand.field is not None:
                raise bad_request(f"{cand.field}: the grammar cannot be compiled: {reason}", cand.field)
            log.warning("tool calls left unbound: their grammar does not compile: %s", reason)
        return None

    @property
    def checked(self) -> bool:
        """Every candidate's answer is known (cached): settling costs nothing."""
        return all(c.error is not None or _key(c.constraint) in _CHECKED for c in self.candidates)


def constraint_plan(api: ApiContext, conv: Conversation, in_reasoning: bool = False) -> Optional[ConstraintPlan]:
    """The conversation's constraint candidates (module rules). A response format for a
    model that reasons lets it think first (`in_reasoning`: the prompt opened the think
    block). Tool schemas that do not compile even leniently leave the calls unbound
    (logged), as before grammars: they are not the client's request for structured
    output; the response format is tried next."""
    fmt = conv.output_format
    mode = conv.tool_choice.mode
    if not conv.tools or (mode == "none" and fmt is not None):
        if fmt is None:
            return None
        constraint = fmt.constraint
        if api.template.reasoning:
            constraint = grammar.after_reasoning(constraint, in_reasoning, api.tokenizer.added_tokens)
        return ConstraintPlan((Candidate(constraint, fmt.field),))
    parallel = conv.parallel_tool_calls if conv.parallel_tool_calls is not None else mode == "auto"
    with_fmt = fmt.constraint if fmt is not None and mode == "auto" else None
    try:
        reasoning = ("opened" if in_reasoning else "optional") if api.template.reasoning else None
        lark = grammar.tool_call_grammar(conv.tools, mode, conv.tool_choice.name, parallel,
                                         api.tokenizer.added_tokens, with_fmt, reasoning,
                                         dict(conv.tool_grammars))
        tools = Candidate(Constraint("tool_calls", lark), None)
    except grammar.GrammarError as exc:
        tools = Candidate(None, None, str(exc))
    if fmt is not None and mode in ("auto", "none"):
        return ConstraintPlan((tools, Candidate(fmt.constraint, fmt.field)))
    return ConstraintPlan((tools,))


def answer_constraint(api: ApiContext, conv: Conversation, in_reasoning: bool = False) -> Optional[Constraint]:
    """The conversation's Constraint, checked here and now; a 400 names the bad field."""
    plan = constraint_plan(api, conv, in_reasoning)
    return plan.settle(lambda c: _check(api, c)) if plan is not None else None


async def settled(api: ApiContext, prompt: Prompt) -> Prompt:
    """The prompt with its constraint checked on the grammar thread (a 400 names the bad
    field), the event loop free meanwhile; a prompt with nothing to check as it is."""
    if prompt.pending is None:
        return prompt
    plan = prompt.pending
    loop = asyncio.get_running_loop()
    constraint = await loop.run_in_executor(_grammar_thread(), plan.settle, lambda c: _check(api, c))
    return dataclasses.replace(prompt, constraint=constraint, pending=None)


def chat_prompt(api: ApiContext, conv: Conversation, max_tokens: Optional[int]) -> Prompt:
    """Render, tokenize, force the tool choice, fit max_tokens, make the constraint."""
    refuse_far_too_long(api, conversation_chars(conv), "messages")
    ids, in_reasoning, forced, use_tools = _render(api, conv)
    plan = constraint_plan(api, conv, in_reasoning)
    constraint, pending = None, None
    if plan is not None:
        if plan.checked or api.prompt_pool is None:  # cached, or no event loop to keep free here
            constraint = plan.settle(lambda c: _check(api, c))
        else:
            pending = plan  # settled() checks it on the grammar thread
    fitted = fit_max_tokens(api, len(ids), max_tokens, "messages")
    return Prompt(
        ids=tuple(ids),
        max_tokens=fitted,
        forced_text=forced,
        parse_tools=use_tools,
        parse_reasoning=api.template.reasoning,
        starts_in_reasoning=in_reasoning,
        tool_names=tool_names(conv.tools) if use_tools else (),
        constraint=constraint,
        pending=pending,
    )


def count_chat_tokens(api: ApiContext, conv: Conversation) -> int:
    """Prompt tokens the conversation uses after the template, tools and forcing included."""
    return len(_render(api, conv)[0])


def text_prompt(api: ApiContext, text: str, max_tokens: Optional[int], param: str = "prompt") -> Prompt:
    """A plain prompt (Completions): no template; BOS added when the model wants it."""
    tok = api.tokenizer
    refuse_far_too_long(api, len(text), param)
    ids = list(tok.encode(text))
    bos = tok.bos_id
    if tok.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    if not ids:
        raise bad_request("prompt must not be empty.", param)
    fitted = fit_max_tokens(api, len(ids), max_tokens, param)
    return Prompt(ids=tuple(ids), max_tokens=fitted)

"""The readers every surface shares: text content parts, function tools, tool choices.

Rules:
- One algorithm per thing, and each API's own words: a surface passes `PartRules` /
  `ToolWords` / `ChoiceWords` saying which part types hold text, how parts join, which
  defaults a tool gets, and the sentences of its 400s (the wire keeps each API's wording:
  Chat says "messages[0].content must be ...", Messages and Responses "field: must be
  ..."). Every 400's `param` is the dotted path of the field it names.
- Text content is a string, null (""), or a list of parts; a part is an object with a
  `type` (or, where the API allows it, a bare string). A text part's text must be a
  string. Media parts (images, audio, files) are refused by type: the model reads text
  only. Any other type is refused too.
- A function tool is a non-empty name, an optional description (a string) and optional
  parameters (an object; the surface's default when absent).
- A tool choice that needs tools (required, or a named tool) is refused when there are
  none, and a named tool must be among them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional

from mashbox.api.common import bad_request
from mashbox.api.prompt import ToolChoice
from mashbox.http.response import HTTPError


@dataclass(frozen=True)
class Voice:
    """How an API words "FIELD must be WHAT": `must_be` is a format string of field and what."""

    must_be: str

    def error(self, field: str, what: str) -> HTTPError:
        return bad_request(self.must_be.format(field=field, what=what), field)


OPENAI_CHAT = Voice("{field} must be {what}.")
COLON = Voice("{field}: must be {what}")  # Messages and Responses


@dataclass(frozen=True)
class PartRules:
    """One API's text content: which part types carry text and how the texts join."""

    voice: Voice
    text_keys: Mapping[str, str]  # part type -> the key of its text (checked to be a string)
    media: tuple[str, ...]  # part types refused as media
    media_words: str  # format string of field (the part's .type) and kind
    other_words: str  # the same, for any other type
    shape_what: str  # what a content value that is not a list must be
    object_what: str  # what a list item must be
    joiner: str = "\n\n"
    bare_strings: bool = False  # list items may be plain strings
    strings_joiner: Optional[str] = None  # the joiner when every item is a plain string
    loose_keys: Mapping[str, str] = field(default_factory=dict)  # part type -> key, taken as str() unchecked


def text_of(content: Any, param: str, rules: PartRules) -> str:
    """A content value -> its text (see the module rules); a 400 names the first bad part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise rules.voice.error(param, rules.shape_what)
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if isinstance(part, str) and rules.bare_strings:
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise rules.voice.error(p, rules.object_what)
        kind = part.get("type")
        if kind in rules.text_keys:
            key = rules.text_keys[kind]
            text = part.get(key)
            if not isinstance(text, str):
                raise rules.voice.error(f"{p}.{key}", "a string")
            texts.append(text)
        elif kind in rules.loose_keys:
            texts.append(str(part.get(rules.loose_keys[kind], "")))
        elif kind in rules.media:
            raise bad_request(rules.media_words.format(field=f"{p}.type", kind=kind), f"{p}.type")
        else:
            raise bad_request(rules.other_words.format(field=f"{p}.type", kind=kind), f"{p}.type")
    if rules.strings_joiner is not None and all(isinstance(p, str) for p in content):
        return rules.strings_joiner.join(texts)
    return rules.joiner.join(texts)


# ---------------------------------------------------------------------------------------
# Function tools
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolWords:
    """Where one API keeps a function tool's fields (the paths its 400s name) and its defaults."""

    voice: Voice
    name: str = "name"  # the paths below are relative to the tool's own path
    description: str = "description"
    parameters: str = "parameters"
    default_parameters: Mapping = field(default_factory=lambda: {"type": "object", "properties": {}})
    empty_description: bool = False  # an absent description is sent as "" (else left out)


def function_tool(name: Any, description: Any, parameters: Any, param: str, words: ToolWords,
                  prompt_name: Optional[str] = None) -> dict:
    """An HF-style function tool from its three fields, checked; `prompt_name` replaces the
    name the model sees (Responses' namespaced tools)."""
    if not isinstance(name, str) or not name:
        raise words.voice.error(f"{param}.{words.name}", "a non-empty string")
    if parameters is None:
        parameters = dict(words.default_parameters)
    elif not isinstance(parameters, dict):
        raise words.voice.error(f"{param}.{words.parameters}", "an object")
    if description is not None and not isinstance(description, str):
        raise words.voice.error(f"{param}.{words.description}", "a string")
    fn: dict = {"name": prompt_name or name}
    if words.empty_description:
        fn["description"] = description or ""
    fn["parameters"] = parameters
    if description and not words.empty_description:
        fn["description"] = description
    return {"type": "function", "function": fn}


# ---------------------------------------------------------------------------------------
# Tool choices
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChoiceWords:
    """The 400s of a tool choice that cannot be met: no tools for it, or an unknown name."""

    no_tools: Callable[[str], HTTPError]  # mode -> error
    unknown: Callable[[str], HTTPError]  # name -> error


def checked_choice(mode: str, name: Optional[str], names: Collection[str], words: ChoiceWords) -> ToolChoice:
    """auto / none as they are; required needs a tool; named needs that tool."""
    if mode == "required" and not names:
        raise words.no_tools(mode)
    if mode == "named" and name not in names:
        raise words.unknown(name)
    return ToolChoice(mode, name if mode == "named" else None)

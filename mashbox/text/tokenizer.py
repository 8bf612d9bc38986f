"""The tokenizer: text <-> ids for one model, loaded from an HF folder or a GGUF file.

Over ~450 lines: the GGUF vocabulary builders (gpt2 and llama, below) are part of this one
noun; nothing else uses them, and they must agree with the rules stated here.

Rules:
- `encode(text)` treats text as plain text: the string "<|im_end|>" in it becomes the
  ids of its characters, never the control token. Only `encode_marked()` produces
  special-token ids, and only at the positions its caller names (chat.py names the
  template's own markers). Non-special added tokens (`<think>`, `<tool_call>`) are
  matched whole everywhere, as HF tokenizers match them.
- Nothing adds a BOS behind the caller's back: the wrapped `tokenizers.Tokenizer` has no
  post-processor; `encode(..., add_bos=True)` prepends `bos_id` when asked.
- `decode(ids)` skips special tokens (BOS, EOS, control tokens) and keeps added
  non-special ones.
- A GGUF file carries no tokenizer.json: the vocabulary, merges, scores and token types
  are metadata, read with mashbox.gguf_meta (pure Python: the server process imports
  no numpy). Two models are built from it: "gpt2" (byte-level BPE with merges; the split
  regex chosen by `tokenizer.ggml.pre`) and "llama" (SentencePiece-style BPE with byte
  fallback, merges derived from the scores when the file has none).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from mashbox import gguf_meta

log = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1, 2, 3, 4, 5, 6,
)

# Split regexes of the byte-level BPE pre-tokenizers, by tokenizer.ggml.pre. These are the
# published patterns the vocabularies were trained with; a pre type not listed uses GPT-2's
# (ByteLevel's built-in regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEX_BY_PRE = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre types whose vocabulary was trained with every digit split off (SmolLM's
# tokenizer.json: Digits(individual_digits) before the GPT-2 byte-level split).
DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell"})
# Control tokens that end a generation wherever a GGUF file marks them control, besides its
# eos/eot ids: a GGUF has one eos id, while an HF model lists them all in
# generation_config.json (SmolLM2 ends turns with <|im_end|> but may also emit
# <|endoftext|>). llama.cpp keeps an end-of-generation set the same way.
END_OF_GENERATION = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
     "<|return|>", "<|end_of_text|>"}
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be built: missing file, unsupported model type, bad data."""


@dataclass
class Tokenizer:
    """One model's tokenizer. Built by `load_tokenizer`; immutable after that by convention.

    `hf` recognises special tokens in text (use it only where that is wanted);
    `_plain` is the same tokenizer with `encode_special_tokens` on, for client text;
    `_plain_cont` is `_plain` for text that follows a marker (differs only for
    SentencePiece pre-tokenizers that add a space prefix to the start of the text).
    """

    hf: HFTokenizer
    bos_id: Optional[int]
    eos_ids: tuple[int, ...]
    bos_token: Optional[str]
    eos_token: Optional[str]
    special_tokens: dict[str, int]  # content -> id, every added token marked special
    chat_template: Optional[str]
    add_bos: bool
    vocab_size: int
    unk_token: Optional[str] = None
    pad_token: Optional[str] = None
    source: str = ""
    _plain: HFTokenizer = field(default=None, repr=False)  # type: ignore[assignment]
    _plain_cont: HFTokenizer = field(default=None, repr=False)  # type: ignore[assignment]
    _detok_skip: Optional[frozenset] = field(default=None, repr=False)  # detok.py's cache

    def __post_init__(self):
        self.hf.post_processor = None
        self._plain = HFTokenizer.from_str(self.hf.to_str())
        self._plain.encode_special_tokens = True
        cont = _without_prefix_space(self._plain)
        self._plain_cont = cont if cont is not None else self._plain

    # -- encoding -----------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of `text` as plain text (special-token strings stay characters)."""
        ids = _ids(self._plain, text) if text else []
        if add_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def encode_marked(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Ids of a text given as pieces `(text, is_marker)`.

        A marker piece must be exactly one special-token string and becomes its id; other
        pieces are plain text. Text after a marker is encoded as a continuation (no
        SentencePiece space prefix), as HF does when it splits a string at its special
        tokens, so a rendered prompt without injected markers gets HF's ids.
        """
        ids: list[int] = []
        at_start = True
        for text, is_marker in pieces:
            if is_marker:
                tid = self.special_tokens.get(text)
                if tid is None:
                    raise TokenizerError(f"{text!r} is not a special token of this tokenizer")
                ids.append(tid)
            elif text:
                tok = self._plain if at_start else self._plain_cont
                ids.extend(_ids(tok, text))
            at_start = False
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- lookups ------------------------------------------------------------------------
    def token_id(self, content: str) -> Optional[int]:
        return self.hf.token_to_id(content)

    def id_to_token(self, tid: int) -> Optional[str]:
        return self.hf.id_to_token(tid)

    @property
    def added_tokens(self) -> dict[str, int]:
        """Every added token, special or not (`<think>` is usually not special)."""
        return {t.content: i for i, t in self.hf.get_added_tokens_decoder().items()}

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The names a chat template may use: bos_token, eos_token, unk_token, pad_token."""
        out = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


# HF tokenizers' `encode` holds the GIL for its whole run (4 s for 5 MB of text here: every
# other connection waits); `encode_batch` releases it. Below this size the batch call's
# overhead is not worth it and the hold is under a millisecond.
GIL_FREE_CHARS = 16384


def _ids(tok: HFTokenizer, text: str) -> list[int]:
    """Ids of `text` without special tokens; big texts are encoded with the GIL released."""
    if len(text) < GIL_FREE_CHARS:
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode_batch([text], add_special_tokens=False)[0].ids


# -- loading --------------------------------------------------------------------------------
def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of an HF model folder or a .gguf file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _load_hf_folder(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf(path)
    if os.path.isfile(path) and os.path.basename(path) == "tokenizer.json":
        return _load_hf_folder(os.path.dirname(path))
    raise TokenizerError(f"no tokenizer at {path!r}: expected a model folder or a .gguf file")


def _token_content(value) -> Optional[str]:
    """tokenizer_config.json spells a token as a string or as an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{path}: invalid JSON ({e})") from e


def _pick_chat_template(value) -> Optional[str]:
    """A template string, or the "default" one of a list of {name, template}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        return next(iter(named.values()), None)
    return None


def _load_hf_folder(folder: str) -> Tokenizer:
    tok_file = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise TokenizerError(f"{folder}: no tokenizer.json")
    hf = HFTokenizer.from_file(tok_file)
    cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    gen = _read_json(os.path.join(folder, "generation_config.json"))

    bos_token = _token_content(cfg.get("bos_token"))
    eos_token = _token_content(cfg.get("eos_token"))
    bos_id = hf.token_to_id(bos_token) if bos_token else None

    if "add_bos_token" in cfg:
        add_bos = bool(cfg["add_bos_token"])
    else:
        # No flag: the post-processor says (Llama 3's tokenizer.json adds BOS there).
        probe = hf.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id

    eos_ids: list[int] = []
    gen_eos = gen.get("eos_token_id")
    for tid in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if isinstance(tid, int) and tid not in eos_ids:
            eos_ids.append(tid)
    if eos_token and hf.token_to_id(eos_token) is not None:
        tid = hf.token_to_id(eos_token)
        if tid not in eos_ids:
            eos_ids.append(tid)

    template = None
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    if template is None:
        template = _pick_chat_template(cfg.get("chat_template"))
    if template is None:
        tmpl_json = _read_json(os.path.join(folder, "chat_template.json"))
        template = _pick_chat_template(tmpl_json.get("chat_template"))

    special = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    return Tokenizer(
        hf=hf,
        bos_id=bos_id,
        eos_ids=tuple(eos_ids),
        bos_token=bos_token,
        eos_token=eos_token,
        special_tokens=special,
        chat_template=template,
        add_bos=add_bos,
        vocab_size=hf.get_vocab_size(with_added_tokens=True),
        unk_token=_token_content(cfg.get("unk_token")),
        pad_token=_token_content(cfg.get("pad_token")),
        source=folder,
    )


def _load_gguf(path: str) -> Tokenizer:
    try:
        meta = gguf_meta.read(path, tensors=False)
    except (OSError, gguf_meta.GGUFMetaError) as e:
        raise TokenizerError(f"{path}: not a readable GGUF file ({e})") from e
    get = meta.get

    kind = get("tokenizer.ggml.model")
    tokens = get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise TokenizerError(f"{path}: no tokenizer in the GGUF metadata")
    types = get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * len(tokens)
    merges = get("tokenizer.ggml.merges")
    pre = get("tokenizer.ggml.pre", "default")

    if kind == "gpt2":
        hf, skipped = _byte_level_bpe(tokens, types, merges or [], pre)
    elif kind == "llama":
        scores = get("tokenizer.ggml.scores")
        unk_id = get("tokenizer.ggml.unknown_token_id")
        add_space = get("tokenizer.ggml.add_space_prefix", True)
        hf = _sentencepiece_bpe(tokens, types, merges, scores, unk_id, bool(add_space))
        skipped = set()
    else:
        raise TokenizerError(
            f"{path}: tokenizer model {kind!r} is not supported (supported: gpt2, llama)"
        )

    def token_at(key: str) -> tuple[Optional[int], Optional[str]]:
        tid = get(key)
        if tid is None or not (0 <= int(tid) < len(tokens)):
            return None, None
        return int(tid), tokens[int(tid)]

    bos_id, bos_token = token_at("tokenizer.ggml.bos_token_id")
    eos_id, eos_token = token_at("tokenizer.ggml.eos_token_id")
    eot_id, _ = token_at("tokenizer.ggml.eot_token_id")
    eom_id, _ = token_at("tokenizer.ggml.eom_token_id")
    _, unk_token = token_at("tokenizer.ggml.unknown_token_id")
    _, pad_token = token_at("tokenizer.ggml.padding_token_id")
    ends = [t for t in (eos_id, eot_id, eom_id) if t is not None]
    ends += [i for i, t in enumerate(types) if t == TOKEN_CONTROL and tokens[i] in END_OF_GENERATION]
    eos_ids = tuple(dict.fromkeys(ends))

    add_bos = get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # llama.cpp's default: SentencePiece vocabularies add BOS, byte-level ones do not.
        add_bos = kind == "llama"

    special = {
        tokens[i]: i
        for i, t in enumerate(types)
        if t == TOKEN_CONTROL and i not in skipped
    }
    if kind == "llama" and unk_token is not None:
        special.setdefault(unk_token, tokens.index(unk_token))
    return Tokenizer(
        hf=hf,
        bos_id=bos_id,
        eos_ids=eos_ids,
        bos_token=bos_token,
        eos_token=eos_token,
        special_tokens=special,
        chat_template=get("tokenizer.chat_template"),
        add_bos=bool(add_bos),
        vocab_size=len(tokens),
        unk_token=unk_token,
        pad_token=pad_token,
        source=path,
    )


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the alphabet of byte-level vocabularies):
    printable Latin-1 bytes stand for themselves, the other 68 are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(tokens, types, merges, pre: str) -> tuple[HFTokenizer, set[int]]:
    alphabet = set(_byte_to_unicode().values())
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = SPLIT_REGEX_BY_PRE.get(pre)
    if split is not None:
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in DIGIT_SPLIT_PRES:
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        hf.pre_tokenizer = byte_level
    hf.decoder = decoders.ByteLevel()

    # Control tokens become special added tokens, user-defined ones (`<think>`) plain
    # added tokens, so both are matched whole. A control token spelled outside the byte
    # alphabet cannot be in the BPE vocabulary as written; adding it would give it a new
    # id past the model's vocabulary, so it is left out (llama.cpp mislabels a few).
    skipped: set[int] = set()
    control, user = [], []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind not in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            continue
        if not set(tok) <= alphabet:
            skipped.add(i)
            continue
        (control if kind == TOKEN_CONTROL else user).append(
            AddedToken(tok, special=kind == TOKEN_CONTROL, normalized=False)
        )
    if control:
        hf.add_special_tokens(control)
    if user:
        hf.add_tokens(user)
    return hf, skipped


def _derived_merges(tokens, scores, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges a SentencePiece BPE vocabulary implies: every split of a token into two
    tokens, ranked by the merged token's score (higher first), ties by the pieces' ids.
    This is the order llama.cpp's SPM tokenizer applies them in (it merges the adjacent
    pair whose result scores highest)."""
    ranked = []
    for tok, tid in vocab.items():
        if len(tok) < 2:
            continue
        score = float(scores[tid]) if scores is not None else -float(tid)
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            lid, rid = vocab.get(left), vocab.get(right)
            if lid is not None and rid is not None:
                ranked.append((-score, lid, rid, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_bpe(tokens, types, merges, scores, unk_id, add_space: bool) -> HFTokenizer:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    # Only normal and user-defined tokens are merge results; control, byte and unknown
    # tokens are whole symbols the merges never produce.
    mergeable = {
        tok: i
        for tok, i in vocab.items()
        if types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED)
    }
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = _derived_merges(tokens, scores, mergeable)
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    hf = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    hf.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(steps)

    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, types)
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN)
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, types)
        if kind == TOKEN_USER_DEFINED
    ]
    if control:
        hf.add_special_tokens(control)
    if user:
        hf.add_tokens(user)
    return hf


def _without_prefix_space(tok: HFTokenizer) -> Optional[HFTokenizer]:
    """A copy of `tok` whose Metaspace pre-tokenizer adds no space prefix, or None when
    `tok` has no Metaspace that prepends on the first piece only.

    HF's Metaspace(prepend_scheme="first") prefixes only text at offset 0 of the string
    being encoded; text after a special token gets no prefix. Encoding a prompt piece by
    piece must do the same.
    """
    spec = json.loads(tok.to_str())
    changed = False

    def visit(node):
        nonlocal changed
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                changed = True
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    visit(spec.get("pre_tokenizer"))
    if not changed:
        return None
    out = HFTokenizer.from_str(json.dumps(spec))
    out.encode_special_tokens = True
    return out

"""Fixtures for the text layer: the real default model's tokenizer, and tiny tokenizers the
tests build themselves.

- `smol` (session): our Tokenizer for the default model's GGUF.
- `smol_ref` (session): transformers' tokenizer for the same file
  (AutoTokenizer.from_pretrained(dir, gguf_file=name)), the independent reference.
- `qwen_dir` (session): a tiny HF tokenizer folder shaped like Qwen3's: a byte-level BPE
  trained here, `<|im_start|>` / `<|im_end|>` / `<|endoftext|>` special, `<think>`,
  `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` added
  as plain (non-special) tokens, and a Qwen3-like chat template written for these tests
  (thinking with reasoning_content and enable_thinking, tools, tool calls, tool results).
- `spm_gguf` (session): a tiny llama-style GGUF (SentencePiece BPE, byte fallback, no
  merges: tokens + scores + types only), written with gguf.GGUFWriter from a model
  trained here with the sentencepiece library; `.sp` is that SentencePieceProcessor.
"""
from __future__ import annotations

import io
import json
import os
import random
from dataclasses import dataclass

import pytest

QWEN_LIKE_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nThese functions are available. Their signatures, one JSON object a line:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\n\nTo call one, reply with a JSON object of its name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
{%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) %}
{%- set ns.last_user = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- continue %}
{%- elif m.role == 'user' %}
{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set body = m.content if m.content is string else '' %}
{%- set thought = '' %}
{%- if m.reasoning_content is string %}
{%- set thought = m.reasoning_content %}
{%- elif '</think>' in body %}
{%- set thought = body.split('</think>')[0].split('<think>')[-1] %}
{%- set body = body.split('</think>')[-1] %}
{%- endif %}
{%- set body = body.lstrip('\n') %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_user and thought %}
{{- '<think>\n' + thought.strip('\n') + '\n</think>\n\n' }}
{%- endif %}
{{- body }}
{%- if m.tool_calls %}
{%- for call in m.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{%- if loop.first and body or not loop.first %}
{{- '\n' }}
{%- endif %}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}
{{- fn.arguments }}
{%- else %}
{{- fn.arguments | tojson }}
{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- raise_exception('unknown role: ' + m.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}
""".strip()

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def training_corpus() -> list[str]:
    """Deterministic text with code, JSON, several scripts and emoji, for tiny vocabularies."""
    rng = random.Random(1234)
    words = (
        "the a of to and in is it you that he was for on are with as I his they be at one have "
        "this from or had by hot word but what some we can out other were all there when up use "
        "weather city Paris Tokyo tool call function arguments name result temperature sunny "
        "def return import class self None True False print json data value key list dict "
        "naïve café résumé über straße 日本語 東京 中文 天气 한국어 привет мир 😀 👍 🎉"
    ).split()
    lines = []
    for _ in range(1500):
        n = rng.randrange(3, 14)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.2:
            line = json.dumps({"name": rng.choice(words), "arguments": {"city": rng.choice(words)}})
        if rng.random() < 0.1:
            line = f"def f(x):\n    return x * {rng.randrange(100)}  # {rng.choice(words)}\n"
        lines.append(line)
    lines += ["call 1234567 or 123 4567 at 2024"] * 40  # digit merges, to tell split rules apart
    return lines


@pytest.fixture(scope="session")
def smol(default_model_path):
    from mashbox.text.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def smol_ref(default_model_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(default_model_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=QWEN_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])
    folder = tmp_path_factory.mktemp("qwen_like")
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": QWEN_LIKE_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    gen = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return str(folder)


@dataclass
class SpmModel:
    path: str  # the .gguf file
    sp: object  # sentencepiece.SentencePieceProcessor


@pytest.fixture(scope="session")
def spm_gguf(tmp_path_factory) -> SpmModel:
    spm = pytest.importorskip("sentencepiece")
    gguf = pytest.importorskip("gguf")
    import numpy as np

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=800,
        byte_fallback=True,
        normalization_rule_name="identity",  # as Llama's: no NFKC
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        character_coverage=1.0,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        else:
            types.append(1)
    folder = tmp_path_factory.mktemp("spm")
    path = str(folder / "tiny-spm.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.add_chat_template("{% for m in messages %}<s>[{{ m.role }}] {{ m.content }}</s>{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return SpmModel(path=path, sp=sp)

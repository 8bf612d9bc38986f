"""Incremental detokenization equals decoding everything at once, whatever the pushes."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mashbox.text.detok import IncrementalDetokenizer
from mashbox.text.tokenizer import load_tokenizer

MULTIBYTE = "😀👍🏽👨‍👩‍👧🇫🇷 日本語 naïve e\u0301 Привет 🎉"
PROMPTS = ["", "Hi", "<|im_start|>assistant\n", "a 😀", " x y", "日本"]


def run(tok, prompt_ids, gen_ids, cuts) -> tuple[str, list[str]]:
    d = IncrementalDetokenizer(tok, prompt_ids)
    deltas, i = [], 0
    for k in cuts:
        if i >= len(gen_ids):
            break
        deltas.append(d.push(gen_ids[i : i + k]))
        i += k
    if i < len(gen_ids):
        deltas.append(d.push(gen_ids[i:]))
    deltas.append(d.flush())
    return "".join(deltas), deltas


def expected(tok, prompt_ids, gen_ids) -> str:
    full, head = tok.decode(prompt_ids + gen_ids), tok.decode(prompt_ids)
    assert full.startswith(head)
    return full[len(head) :]


def test_emoji_split_across_byte_tokens_never_half_shown(smol):
    ids = smol.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE) // 2  # the emoji really are several byte tokens each
    d = IncrementalDetokenizer(smol, smol.encode("Say: "))
    deltas = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(deltas) == MULTIBYTE
    assert not any("\ufffd" in x for x in deltas)
    assert "" in deltas  # some ids completed nothing on their own


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ids_equal_full_decode_default_model(smol, data):
    pool = smol.encode(MULTIBYTE + " Hello world") + list(range(0, 17)) + [10813, 242, 218, 30, 99, 48000]
    prompt = smol.encode(data.draw(st.sampled_from(PROMPTS)))
    gen = data.draw(st.lists(st.sampled_from(pool), max_size=40))
    cuts = data.draw(st.lists(st.integers(1, 4), max_size=40))
    got, _ = run(smol, prompt, gen, cuts)
    assert got == expected(smol, prompt, gen)


def test_random_ids_many_seeds_default_model(smol):
    rng = random.Random(7)
    for _ in range(300):
        prompt = smol.encode(rng.choice(PROMPTS))
        gen = [rng.randrange(smol.vocab_size) for _ in range(rng.randrange(30))]
        cuts = [rng.randrange(1, 4) for _ in range(30)]
        assert run(smol, prompt, gen, cuts)[0] == expected(smol, prompt, gen)


def test_sentencepiece_spaces_kept(spm_gguf):
    tok = load_tokenizer(spm_gguf.path)
    prompt = tok.encode("the weather", add_bos=True)
    gen = tok.encode("the city is sunny 😀 日本語 ǅ") + [tok.eos_ids[0]]
    got, deltas = run(tok, prompt, gen, [1] * len(gen))
    assert got == expected(tok, prompt, gen) == " the city is sunny 😀 日本語 ǅ"
    # Random outputs made of whole pieces of text (byte-fallback tokens in their order:
    # a shuffled byte group is invalid UTF-8, and ByteFallback turns every byte of an
    # invalid group into U+FFFD, so its text depends on grouping, not on us).
    chunks = ["the", " city", "😀", "日本語", "ǅ", " \n", "sunny", "ꙮ", "x", " 1"]
    rng = random.Random(3)
    for _ in range(200):
        gen = [i for _ in range(rng.randrange(12)) for i in tok.encode(rng.choice(chunks))]
        cuts = [rng.randrange(1, 4) for _ in range(len(gen))]
        assert run(tok, prompt, gen, cuts)[0] == expected(tok, prompt, gen)


def test_special_tokens_skipped_added_tokens_kept(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    gen = tok.encode("<think>hmm</think>done") + [tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")]
    got, _ = run(tok, tok.encode("q"), gen, [1] * len(gen))
    assert got == "<think>hmm</think>done"


def test_window_stays_short(smol):
    """O(1) per token: each push decodes only a few ids, however long the output."""
    ids = smol.encode(("The quick brown fox 😀 jumps over 日本語. " * 300))
    d = IncrementalDetokenizer(smol, smol.encode("x" * 100))
    widest = 0
    for i in ids:
        d.push([i])
        widest = max(widest, len(d._ids) - d._prefix_offset)
    assert widest <= 8


def test_parser_tags_kept_even_when_marked_special(tmp_path, qwen_dir):
    """Some GGUF files mark <think> / <tool_call> as control tokens; the parser must
    still see them, while real control tokens stay hidden."""
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(qwen_dir, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:
        if t["content"] in ("<think>", "</think>", "<tool_call>"):
            t["special"] = True
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(str(folder))
    assert "<think>" in tok.special_tokens
    think, end_think, call = (tok.token_id(t) for t in ("<think>", "</think>", "<tool_call>"))
    gen = [think, *tok.encode("plan"), end_think, *tok.encode("ok"), call, tok.token_id("<|im_end|>")]
    got, _ = run(tok, [tok.token_id("<|im_start|>"), *tok.encode("assistant\n")], gen, [1] * len(gen))
    assert got == "<think>plan</think>ok<tool_call>"

"""TokenBytes: each token's raw bytes, which join up to the text, on a byte-level BPE
(Qwen-shaped HF folder), a SentencePiece GGUF with byte fallback, and the default model."""
from __future__ import annotations

import pytest

from mashbox.text.token_bytes import TokenBytes
from mashbox.text.tokenizer import load_tokenizer

TEXTS = ["Hello world", "naïve 日本語 😀👍🏽 done", " two  spaces\nand a newline"]


def _joined(tok, text: str) -> bytes:
    tb = TokenBytes(tok)
    return b"".join(tb.of(i) for i in tok.encode(text))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bytes_join_to_the_text(qwen_dir, text):
    tok = load_tokenizer(qwen_dir)
    assert _joined(tok, text) == text.encode()


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_bytes_join_to_the_decoded_text(spm_gguf, text):
    tok = load_tokenizer(spm_gguf.path)
    ids = tok.encode(text)
    # the SentencePiece space prefix of the first piece is a real byte of the token
    assert _joined(tok, text).decode().lstrip(" ") == tok.decode(ids)


def test_partial_characters_and_special_tokens(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    tb = TokenBytes(tok)
    ids = tok.encode("😀")
    parts = [tb.of(i) for i in ids]
    assert b"".join(parts) == "😀".encode()
    if len(ids) > 1:  # the emoji is split: a part alone is no character, shown as \x escapes
        assert "\\x" in tb.text(ids[0])
    end = tok.token_id("<|im_end|>")
    assert tb.of(end) == b"" and tb.text(end) == ""  # produces no text
    think = tok.token_id("<think>")
    assert tb.of(think) == b"<think>"  # an added plain token is its content


def test_default_model(smol):
    text = "Emoji 🎉 and ünïcode, spaces  end."
    assert _joined(smol, text) == text.encode()

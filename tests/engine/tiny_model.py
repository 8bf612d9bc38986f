"""A tiny random Llama with a tiny byte-level BPE tokenizer, saved as an HF folder.

transformers (a test-only dependency) makes and saves the model, and is the reference
for greedy parity: `hf_greedy` is a plain loop of full forward passes + argmax.
"""
from __future__ import annotations

import json
import os

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a local inference server answers many requests at once",
    "continuous batching lets a new request join the running batch",
    "prefix caching reuses the keys and values of a shared prompt start",
    "hello world, hello mashbox! numbers: 0123456789",
    "emoji and accents: café naïve 😀 — done",
] * 20


def make_tiny_llama(folder: str, vocab_target: int = 320, seed: int = 0) -> str:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, f)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tok.token_to_id("</s>"), "bos_token_id": tok.token_to_id("<s>")}, f)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties in argmax
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_greedy(folder: str, prompt_ids, n: int) -> list[int]:
    """n greedy tokens from transformers, one full forward pass per token (float32)."""
    import torch
    from transformers import LlamaForCausalLM

    model = _cached_model(folder)
    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            t = int(torch.argmax(logits))
            out.append(t)
            ids.append(t)
    return out


_MODELS: dict = {}


def _cached_model(folder: str):
    import torch
    from transformers import LlamaForCausalLM

    if folder not in _MODELS:
        _MODELS[folder] = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return _MODELS[folder]

"""The default model end to end against transformers, the independent reference.

transformers loads the same GGUF file itself (`gguf_file=`): its own dequantization, its
own tokenizer and its own chat template rendering. For a handful of chat prompts the
prompt ids must be equal, and mashbox's greedy tokens (engine worker, float32, several
requests batched together) must equal transformers' greedy `generate`.
"""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

from mashbox.config import EngineConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "engine"))
from engine_harness import collect, req, run_client  # noqa: E402

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? One word."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three planets."}],
    [{"role": "user", "content": "Write a haiku about the sea 🌊."},
     {"role": "assistant", "content": "Waves fold into foam,"},
     {"role": "user", "content": "Now one about mountains, in Français s'il vous plaît."}],
    [{"role": "user", "content": "def add(a, b):\n    return a + b\n\nExplain this code."}],
]


@pytest.fixture(scope="module")
def reference(default_model_path):
    transformers = pytest.importorskip("transformers")
    import torch

    folder, name = os.path.split(default_model_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    model.eval()
    return hf_tok, model


def hf_greedy(hf_tok, model, ids: list[int]) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=hf_tok.eos_token_id)
    return out[0, len(ids):].tolist()  # ends with the EOS id when the turn ended


def engine_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    cfg = EngineConfig(model_path=path, model_id="smollm2-135m", slots=4, ctx=1024, dtype="float32",
                       threads=1)

    async def main(client):
        handles = [client.submit(req(f"p{i}", p, NEW_TOKENS)) for i, p in enumerate(prompts)]
        return [got.ids for got in await asyncio.gather(*(collect(h) for h in handles))]

    return run_client(main, cfg)


def test_prompt_ids_and_greedy_tokens_equal_transformers(default_model_path, reference):
    from mashbox.text.chat import ChatTemplate
    from mashbox.text.tokenizer import load_tokenizer

    hf_tok, model = reference
    tok = load_tokenizer(default_model_path)
    template = ChatTemplate(tok)
    prompts = []
    for conv in CONVERSATIONS:
        ours = template.build(conv, add_generation_prompt=True).ids
        theirs = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if isinstance(theirs, dict) or hasattr(theirs, "input_ids"):
            theirs = theirs["input_ids"]
        assert list(ours) == list(theirs), conv
        prompts.append(list(ours))

    got = engine_greedy(default_model_path, prompts)
    assert any(len(g) < NEW_TOKENS for g in got) and any(len(g) == NEW_TOKENS for g in got)
    for conv, prompt, ours in zip(CONVERSATIONS, prompts, got):
        expected = hf_greedy(hf_tok, model, prompt)
        assert ours == expected, (conv[-1]["content"], tok.decode(ours), tok.decode(expected))


def test_int4_weights_end_to_end(default_model_path):
    """`--weights int4` (opt-in): the same engine path on quantized linears still answers."""
    from mashbox.text.chat import ChatTemplate
    from mashbox.text.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path)
    ids = list(ChatTemplate(tok).build(CONVERSATIONS[0]).ids)
    cfg = EngineConfig(model_path=default_model_path, model_id="smollm2-135m", slots=2, ctx=512,
                       threads=1, weights="int4")

    async def main(client):
        return (await collect(client.submit(req("q", ids, 16)))).events, client.info

    events, info = run_client(main, cfg)
    text = "".join(ev.text for ev in events)
    assert info.dtype == "bfloat16"  # auto is held to bfloat16 for quantized linears
    assert "Paris" in text and events[-1].finish_reason == "stop", text

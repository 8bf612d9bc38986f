"""The default model (SmolLM2-135M Q4_1) on its own blocks (weights "gguf", the default
for a GGUF on a CPU with AVX512-BF16 or AVX2) against the dequantized reference: mashbox's
float32 dense decoder, which tests/test_default_model_parity.py holds equal to
transformers' greedy text on the same file.

Both bfloat16 paths (blocks, and today's dense bfloat16) round activations, so on a
near-tie of the reference's two best logits either may pick the other token (measured on
these prompts: each does so once in 96 tokens, at margins of 0.05-0.07). So the check is
teacher-forced along the reference's greedy text: wherever its top two logits are at
least MARGIN apart, the blocks pick the same token, and their logits are no further from
the reference than dense bfloat16's are."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from mashbox.model import linear, loader
from mashbox.model.decoder import Batch, Decoder
from mashbox.model.kv_cache import KVCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_default_model_parity import CONVERSATIONS, NEW_TOKENS  # noqa: E402

CPU = torch.device("cpu")
MARGIN = 0.25


def _decoder(path: str, dtype: torch.dtype, weights: str) -> Decoder:
    w = loader.load(path, dtype, CPU, blocks=weights == "gguf")
    return Decoder(w.config, w.tensors, dtype, CPU, weights=weights)


def _logits_along(decoder: Decoder, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """[len(forced), vocab]: the logits before each forced token (prompt, then forced ones)."""
    cache = KVCache(decoder.config, slots=1, ctx=512, dtype=decoder.dtype, device=CPU)
    rows = [decoder(Batch.build([(0, 0, prompt)]), cache)[0]]
    for i, tok in enumerate(forced[:-1]):
        rows.append(decoder(Batch.build([(0, len(prompt) + i, [tok])], decode=(True,)), cache)[0])
    return torch.stack(rows)


def _greedy(decoder: Decoder, prompt: list[int]) -> list[int]:
    cache = KVCache(decoder.config, slots=1, ctx=512, dtype=decoder.dtype, device=CPU)
    logits, out = decoder(Batch.build([(0, 0, prompt)]), cache)[0], []
    for i in range(NEW_TOKENS):
        out.append(int(logits.argmax()))
        logits = decoder(Batch.build([(0, len(prompt) + i, out[-1:])], decode=(True,)), cache)[0]
    return out


def test_blocks_follow_the_dequantized_greedy_text(default_model_path):
    from mashbox import native

    if not (native.NATIVE and native.blocks_kernel_runs()):
        pytest.skip("weights gguf is the default only with csrc's AVX512-BF16 or AVX2 kernel (the portable one "
                    "is for tests)")
    from mashbox.text.chat import ChatTemplate
    from mashbox.text.tokenizer import load_tokenizer

    template = ChatTemplate(load_tokenizer(default_model_path))
    reference = _decoder(default_model_path, torch.float32, "dense")
    blocks = _decoder(default_model_path, torch.bfloat16, "gguf")
    dense = _decoder(default_model_path, torch.bfloat16, "dense")
    assert isinstance(blocks.layers[0].qkv, linear.QuantLinear) and isinstance(blocks.lm_head, linear.QuantLinear)
    checked = blocks_err = dense_err = 0.0
    for conv in CONVERSATIONS:
        prompt = list(template.build(conv, add_generation_prompt=True).ids)
        text = _greedy(reference, prompt)
        want = _logits_along(reference, prompt, text)
        got = _logits_along(blocks, prompt, text)
        top2 = want.topk(2, dim=1).values
        clear = (top2[:, 0] - top2[:, 1]) >= MARGIN
        assert torch.equal(got.argmax(1)[clear], want.argmax(1)[clear]), conv
        checked += int(clear.sum())
        blocks_err += float((got - want).abs().mean())
        dense_err += float((_logits_along(dense, prompt, text) - want).abs().mean())
    assert checked >= 0.8 * len(CONVERSATIONS) * NEW_TOKENS
    # measured: blocks 0.104, dense bfloat16 0.105 (mean |logit difference|, summed / 4)
    assert blocks_err <= 1.25 * dense_err, (blocks_err, dense_err)


def test_weights_auto_takes_the_files_blocks_where_they_run(default_model_path):
    """auto is the file's own blocks wherever they run (bfloat16 on a CPU with csrc's
    AVX512-BF16 or AVX2 kernel), the default model included; dense elsewhere."""
    from mashbox import native
    from mashbox.engine.runner import _weight_format

    path, cpu = str(default_model_path), torch.device("cpu")
    runs = native.NATIVE and native.blocks_kernel_runs()
    assert _weight_format("auto", path, cpu, torch.bfloat16) == ("gguf" if runs else "dense")
    assert _weight_format("auto", path, cpu, torch.float32) == "dense"  # blocks run in bfloat16 only
    assert _weight_format("dense", path, cpu, torch.bfloat16) == "dense"


def test_the_files_blocks_take_the_files_memory(default_model_path):
    from mashbox.config import EngineConfig
    from mashbox.engine.runner import Runner

    from mashbox import native

    if not (native.NATIVE and native.blocks_kernel_runs()):
        pytest.skip("weights gguf needs csrc's AVX512-BF16 or AVX2 kernel")
    runner = Runner(EngineConfig(model_path=default_model_path, model_id="m", slots=1, ctx=64, weights="gguf"))
    assert runner.weight_format == "gguf" and runner.dtype == torch.bfloat16
    file_bytes = os.path.getsize(default_model_path)
    # resident weights: the blocks (Q4_1, a Q8_0 embedding/head) and the float32 norms
    assert runner.weight_bytes <= 1.1 * file_bytes, (runner.weight_bytes, file_bytes)
    # auto is the blocks, in bfloat16 (on an AVX2 CPU too, where torch's dtype auto is
    # float32); dense bfloat16 holds 2.8x their bytes
    auto = Runner(EngineConfig(model_path=default_model_path, model_id="m", slots=1, ctx=64))
    assert auto.weight_format == "gguf" and auto.weight_bytes == runner.weight_bytes
    assert auto.dtype == torch.bfloat16
    dense = Runner(EngineConfig(model_path=default_model_path, model_id="m", slots=1, ctx=64, weights="dense"))
    assert dense.weight_format == "dense" and dense.weight_bytes > 2 * runner.weight_bytes

"""--rope-scaling / --rope-scale reach the model: EngineConfig -> a real worker process ->
greedy tokens past the trained length equal transformers' with that scaling in its
config.json.

The tiny Llama's config is given a trained length of 64 positions; slots of ctx 128 hold
a 100-token prompt and 20 new tokens, so every new token sits past the trained length.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import pytest

from mashbox.config import EngineConfig, GenerationRequest, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from engine_harness import run_client  # noqa: E402
from tiny_model import hf_greedy, make_tiny_llama  # noqa: E402

TRAINED = 64
CTX = 128
NEW = 20


def _with_config(src: str, dest: str, **changes) -> str:
    shutil.copytree(src, dest)
    path = os.path.join(dest, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return dest


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope-flags")
    tiny = make_tiny_llama(str(root / "base"))
    plain = _with_config(tiny, str(root / "plain"), max_position_embeddings=TRAINED)
    yarn = _with_config(tiny, str(root / "yarn"), max_position_embeddings=TRAINED, rope_scaling={
        "rope_type": "yarn", "factor": CTX / TRAINED, "original_max_position_embeddings": TRAINED})
    linear = _with_config(tiny, str(root / "linear"), max_position_embeddings=TRAINED,
                          rope_scaling={"rope_type": "linear", "factor": 2.0})
    return {"plain": plain, "yarn": yarn, "linear": linear}


def _greedy(path: str, prompt: list[int], **flags) -> list[int]:
    cfg = EngineConfig(model_path=path, model_id="tiny", slots=2, ctx=CTX, dtype="float32",
                       device="cpu", prefill_chunk=48, threads=1, **flags)
    assert EngineConfig(**dataclasses.asdict(cfg)) == cfg  # what crosses the pipe at start

    async def main(client):
        req = GenerationRequest(id="r", tenant="t", prompt_ids=tuple(prompt), sampling=SamplingParams(),
                                max_tokens=NEW, ignore_eos=True)
        return [t async for ev in client.submit(req) for t in ev.token_ids]
    return run_client(main, cfg, timeout=120)


@pytest.mark.parametrize("flags, like", [
    ({"rope_scaling": "yarn"}, "yarn"),  # factor ctx / trained = 2, original 64
    ({"rope_scale": 2.0}, "linear"),  # --rope-scale alone on a plain model: linear
])
def test_flags_over_a_plain_model_give_transformers_scaled_tokens(folders, flags, like):
    prompt = [(7 * i + 3) % 300 + 2 for i in range(100)]
    want = hf_greedy(folders[like], prompt, NEW)
    assert want != hf_greedy(folders["plain"], prompt, NEW), "the scaling must change the tokens"
    assert _greedy(folders["plain"], prompt, **flags) == want


def test_rope_scaling_none_drops_the_models_own(folders):
    prompt = [(5 * i + 1) % 300 + 2 for i in range(100)]
    assert _greedy(folders["yarn"], prompt, rope_scaling="none") == hf_greedy(folders["plain"], prompt, NEW)


@pytest.mark.parametrize("kw, named", [
    ({"rope_scaling": "ntk"}, "rope_scaling"),
    ({"rope_scale": 0.5}, "rope_scale"),
    ({"rope_scale": float("nan")}, "rope_scale"),
    ({"rope_scaling": "none", "rope_scale": 2.0}, "rope_scale"),
])
def test_engine_config_refuses_bad_rope_values(kw, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(model_path="x", model_id="x", **kw)

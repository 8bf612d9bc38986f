"""GGUFWeights: one .gguf file read as a ModelConfig and HF-named torch tensors.

Rules:
- The file is memory-mapped (copy-on-write, so torch can view it without a copy and
  without ever writing it). Each tensor is dequantized straight into the target dtype,
  one at a time; only the mapping and the finished weights stay alive.
- With `blocks` (the loader's choice for weights "gguf"), the 2-d tensors of those
  block types stay in the file's bytes (BlockWeight, a view of the mapping; a copy only
  where q/k rows are permuted), for the decoder's QuantLinear.
- Hyper-parameters come from the `{arch}.*` metadata; the flags the metadata does not
  carry are read off the tensor names (q/k norms, attention biases, a separate output
  head). llama.cpp's converter permutes the rows of q and k of `llama`-architecture files
  (it turns HF's rotate-half rope into ggml's interleaved one); we undo that permutation
  so one decoder serves both kinds of file. qwen2/qwen3 files are stored unpermuted.
- A truncated or malformed file raises ModelError naming the file.
"""
from __future__ import annotations

import logging
import os
import re
import time
from typing import Iterator, Optional, Union

import numpy as np
import torch

from mashbox.model import quants
from mashbox.model.block_weight import BlockWeight
from mashbox.model.errors import ModelError
from mashbox.model.fused_layout import FusedLayout
from mashbox.model.model_config import GGUF_ARCHITECTURES as _ARCHES
from mashbox.model.model_config import ModelConfig, rope_params, yarn_mscale

log = logging.getLogger(__name__)

# Architectures whose q/k rows llama.cpp's converter permutes.
_PERMUTED_ARCHES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

PROGRESS_EVERY_S = 2.0


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ModelError(f"unexpected tensor {gguf_name!r} in GGUF file (not a llama/qwen2/qwen3 "
                         f"decoder tensor)")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute_rows(n_heads: int, rows: int) -> torch.Tensor:
    """Row order that turns llama.cpp's interleaved-rope q/k rows back into HF order.

    The converter stored row (h, i, j) of the view [heads, head_dim/2, 2] at the place
    of HF row (h, j, i) of [heads, 2, head_dim/2]; HF row r is file row perm[r].
    """
    half = rows // n_heads // 2
    return torch.arange(rows).reshape(n_heads, half, 2).transpose(1, 2).reshape(rows)


def _reader_class():
    """gguf.GGUFReader that parses through a plain ndarray view of its mapping.

    GGUFReader slices its np.memmap once per metadata value, and numpy's memmap subclass
    hooks make that three times slower than slicing an ndarray: over a second for the
    ~100k tokenizer strings of a small model. The view keeps the mapping alive (it is its
    base). Deferred import: gguf is only needed for GGUF files.
    """
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)

    return Reader


class GGUFWeights:
    def __init__(self, path: str):
        self.path = path
        try:
            self._reader = _reader_class()(path, "c")
        except FileNotFoundError:
            raise ModelError(f"model file not found: {path}") from None
        except (ValueError, IndexError, KeyError, OSError, TypeError) as e:
            raise ModelError(f"{path} is not a readable GGUF file (corrupt or truncated?): {e}") from None
        size = os.path.getsize(path)
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelError(f"{path} is truncated: tensor {t.name} ends past the end of the file")
        gguf_arch = self._meta("general.architecture")
        if gguf_arch not in _ARCHES:
            raise ModelError(f"unsupported architecture {gguf_arch!r} in {path}; "
                             f"supported: {', '.join(_ARCHES)}")
        for t in self._reader.tensors:
            if t.tensor_type.name not in quants.SUPPORTED_TYPES:
                raise ModelError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which mashbox "
                                 f"cannot dequantize; supported: {', '.join(quants.SUPPORTED_TYPES)}")
        self.config = self._read_config(gguf_arch)

    def _meta(self, key: str, default=None):
        """A metadata value (str, int, float or list), or default when absent."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def _read_config(self, gguf_arch: str) -> ModelConfig:
        a = gguf_arch
        names = {t.name for t in self._reader.tensors}
        shapes = {t.name: [int(x) for x in t.shape] for t in self._reader.tensors}

        def need(key: str):
            value = self._meta(f"{a}.{key}")
            if value is None:
                raise ModelError(f"{self.path} lacks metadata {a}.{key}")
            return value

        hidden = int(need("embedding_length"))
        heads = int(need("attention.head_count"))
        kv_heads = int(self._meta(f"{a}.attention.head_count_kv", heads))
        head_dim = int(self._meta(f"{a}.attention.key_length", hidden // heads))
        rope_dim = int(self._meta(f"{a}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ModelError(f"partial rotary embedding (rope.dimension_count {rope_dim} < head_dim "
                             f"{head_dim}) is not supported")
        # The embedding's rows are the model's vocabulary (some files pad it past the
        # tokenizer's token count, as HF's config.vocab_size does).
        if "token_embd.weight" not in shapes:
            raise ModelError(f"{self.path} lacks tensor token_embd.weight")
        vocab = shapes["token_embd.weight"][1]  # ggml lists dims innermost first: [hidden, vocab]
        context = int(need("context_length"))
        scaling = self._rope_scaling(a, context, need)
        if "rope_freqs.weight" in names:
            if scaling is not None:  # as before: the trained frequencies win
                log.warning("%s: rope scaling %s ignored beside its rope_freqs tensor",
                            self.path, scaling["rope_type"])
            factors = self._plain_tensor("rope_freqs.weight")
            scaling = {"rope_type": "freq_factors", "factors": tuple(float(x) for x in factors)}
        window = self._meta(f"{a}.attention.sliding_window")
        return ModelConfig(
            arch=_ARCHES[gguf_arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._meta(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            sliding_window=int(window) if window else None,
        )

    def _rope_scaling(self, a: str, context: int, need) -> Optional[dict]:
        """rope.scaling.* as a ModelConfig rope_scaling dict (llama.cpp's meaning of each key).

        linear: factor. yarn: factor, original_context_length (default: context_length),
        yarn_beta_fast / yarn_beta_slow (default 32 / 1), and attn_factor, which llama.cpp
        multiplies into YaRN's own 0.1 ln(factor) + 1 (default 1). yarn_ext_factor other
        than llama.cpp's full ramp (1, or the -1 that means "default") and
        yarn_log_multiplier (DeepSeek's mscale_all_dim) are refused, not ignored."""
        kind = self._meta(f"{a}.rope.scaling.type", "none")
        if kind in ("none", None):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
        if kind != "yarn":
            raise ModelError(f"unsupported rope scaling type {kind!r} in {self.path}; supported: "
                             "none, linear, yarn")
        ext = self._meta(f"{a}.rope.scaling.yarn_ext_factor")
        if ext is not None and float(ext) not in (-1.0, 1.0):
            raise ModelError(f"{self.path}: rope.scaling.yarn_ext_factor {ext} is not supported (only 1)")
        if self._meta(f"{a}.rope.scaling.yarn_log_multiplier"):
            raise ModelError(f"{self.path}: rope.scaling.yarn_log_multiplier is not supported")
        factor = float(need("rope.scaling.factor"))
        original = int(self._meta(f"{a}.rope.scaling.original_context_length", context))
        attn = float(self._meta(f"{a}.rope.scaling.attn_factor", 1.0))
        params = {"factor": factor, "original_max_position_embeddings": original,
                  "attention_factor": attn * yarn_mscale(factor)}
        for key, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            value = self._meta(f"{a}.rope.scaling.{name}")
            if value is not None:
                params[key] = float(value)
        return rope_params("yarn", params, context)

    def _plain_tensor(self, name: str) -> np.ndarray:
        for t in self._reader.tensors:
            if t.name == name:
                return np.asarray(t.data, dtype=np.float32).reshape(-1)
        raise ModelError(f"{self.path} lacks tensor {name}")

    @property
    def bits_per_weight(self) -> float:
        bits = sum(8 * t.n_bytes for t in self._reader.tensors)
        return bits / max(1, sum(int(t.n_elements) for t in self._reader.tensors))

    @property
    def nbytes(self) -> int:
        return sum(int(t.n_bytes) for t in self._reader.tensors)

    def tensors(self, dtype: torch.dtype, device: torch.device, layout: Optional[FusedLayout] = None,
                blocks: tuple[str, ...] = ()) -> Iterator[tuple[str, Union[torch.Tensor, BlockWeight]]]:
        """Yield (HF name, tensor in `dtype` on `device`) one tensor at a time; members of
        fused weights are written into `layout`'s buffers. 2-d tensors whose ggml type is
        in `blocks` come as BlockWeight instead: their quantized bytes, not dequantized."""
        cfg = self.config
        permute = cfg.arch in _PERMUTED_ARCHES
        todo = [t for t in self._reader.tensors if t.name != "rope_freqs.weight"]
        start = last = time.monotonic()
        done_bytes, total_bytes = 0, sum(int(t.n_bytes) for t in todo)
        for i, t in enumerate(todo):
            name = hf_name(t.name)
            shape = [int(x) for x in reversed(t.shape)]  # ggml lists dims innermost first
            type_name = t.tensor_type.name
            try:
                raw = torch.from_numpy(t.data.reshape(-1).view(np.uint8))
            except ValueError as e:
                raise ModelError(f"{self.path}: tensor {t.name} is malformed: {e}") from None
            rows = int(np.prod(shape[:-1]))  # 1 for a vector
            raw = raw.reshape(rows, -1)
            perm = None
            if permute and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
                heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
                perm = _unpermute_rows(heads, shape[0])
                if len(shape) == 2:
                    raw = raw[perm]  # permutes the quantized rows: a copy of bytes, not floats
            if len(shape) == 2 and type_name in blocks:
                done_bytes += int(t.n_bytes)
                yield name, BlockWeight(type_name, raw, (shape[0], shape[1]))
                continue
            dest = layout.destination(name, tuple(shape)) if layout is not None else None
            value = quants.dequantize(raw, type_name, shape[-1], dtype, device,
                                      out=None if dest is None else dest.view(rows, shape[-1]))
            value = value.view(shape)
            if perm is not None and len(shape) == 1:
                value.copy_(value[perm.to(device)])
            done_bytes += int(t.n_bytes)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                log.info("loading %s: %d/%d tensors, %.0f%% of %.0f MB, %.1f s",
                         os.path.basename(self.path), i + 1, len(todo),
                         100.0 * done_bytes / total_bytes, total_bytes / 1e6, now - start)
            yield name, value.reshape(shape)
        log.info("loaded %d tensors from %s in %.1f s", len(todo), self.path, time.monotonic() - start)

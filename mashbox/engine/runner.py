"""Runs a step plan: plan rows -> model Batch -> Decoder.forward -> logits -> native.sample.

All tensor work of the engine lives here. Buffers are made once at start:
- input ids / positions: int64[max_step_tokens], filled by slicing (no per-step tensors
  or arrays on the host; on CUDA one copy each to device buffers of the same size);
- sampling params float32[slots, 7] and RNG states uint64[slots], one row per slot, set
  when a request is admitted into the slot, so a row's draws depend on its own seed only;
- the KV cache [layers, slots, kv_heads, ctx, head_dim] (model.kv_cache.KVCache);
- with --cache-ram, the host pool (model.kv_cache.HostPool): the scheduler's saves and
  restores are copied before the forward, saves first (a save may reuse a pool block a
  later restore of the same plan must not see: the scheduler pins those).
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from mashbox import gguf_meta, native
from mashbox.config import LOGPROB_FLOOR, EngineConfig, SamplingParams, TokenLogprob
from mashbox.engine.scheduler import StepPlan
from mashbox.model import decoder as decoder_mod
from mashbox.model import kv_cache as kv_cache_mod
from mashbox.model import loader
from mashbox.model.block_weight import tensor_bytes
from mashbox.model.device import device_and_dtype, pick_device
from mashbox.model.errors import ModelError
from mashbox.model.layer_loop import StepLimits

if TYPE_CHECKING:
    from mashbox.engine.constraints import ConstraintTable

log = logging.getLogger("mashbox.engine.runner")

_EMPTY_I32 = np.zeros(0, dtype=np.int32)


def _available_bytes() -> int:
    """MemAvailable (Linux), else all physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# weights "auto" keeps a GGUF's blocks (the file's own quantization) wherever they run. A
# decode step reads every weight once, and the blocks read 1.9x (Q8_0) to 3.4x (Q4_K_M)
# fewer bytes than dense bfloat16, in as many fewer bytes of memory. The default model
# too: 97 MB of blocks against 270 MB dense, which decode and prefill faster than its
# dense weights where measured (README, Quantized weights).
def _weight_format(asked: str, path: str, device: torch.device, dtype: torch.dtype) -> str:
    """The Decoder's weights for the config's: "auto" is "gguf" (the file's
    own quantized blocks, csrc/quant.c and kquant.c) for a .gguf file in bfloat16 on a CPU
    where csrc's AVX512-BF16 or AVX2 kernel runs, else "dense"; an explicit "gguf" that
    cannot run here is a ModelError."""
    runs = (loader.is_gguf(path) and device.type == "cpu" and dtype == torch.bfloat16 and native.NATIVE
            and native.blocks_kernel_runs())
    if asked == "auto":
        if not runs:
            return "dense"
        dense_bytes = 2 * sum(t.n_elements for t in gguf_meta.read(path).tensors)
        log.info("weights auto: gguf (dense bfloat16 would be %.1f GB)", dense_bytes / 1e9)
        return "gguf"
    if asked == "gguf" and not (loader.is_gguf(path) and device.type == "cpu" and dtype == torch.bfloat16):
        raise ModelError(f"weights gguf needs a .gguf model in bfloat16 on a CPU ({path}, {dtype}, {device})")
    return asked


def _gguf_on_avx2(cfg: EngineConfig) -> bool:
    """A .gguf file on a CPU whose fastest csrc kernel is the AVX2 one."""
    return (loader.is_gguf(cfg.model_path) and native.NATIVE and native.bf16_kernel() == native.KERNEL_AVX2
            and pick_device(cfg.device).type == "cpu")


def sampling_row(p: SamplingParams) -> tuple[float, ...]:
    """The 7 float32 columns native.sample reads for one row."""
    return (
        p.temperature,
        p.top_p,
        float(p.top_k),
        p.min_p,
        p.repetition_penalty,
        p.frequency_penalty,
        p.presence_penalty,
    )


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class Runner:
    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        hidden = loader.read_config(cfg.model_path).hidden_size  # sizes the auto-dtype probe
        # quantized linears run in bfloat16 only: auto does not get to pick float32 for them
        dtype = "bfloat16" if cfg.weights not in ("dense", "auto") and cfg.dtype == "auto" else cfg.dtype
        if cfg.weights == "auto" and cfg.dtype == "auto" and _gguf_on_avx2(cfg):
            # torch's bfloat16 is emulated on such a CPU (auto_dtype's float32), but the blocks'
            # kernels, attention and layer loop are csrc's: bfloat16 there reads the file's
            # bytes instead of 4 per weight (README, Quantized weights)
            log.info("dtype auto -> bfloat16: the GGUF's blocks run on csrc's AVX2 kernels")
            dtype = "bfloat16"
        self.device, self.dtype = device_and_dtype(cfg.device, dtype, hidden)
        # weights "auto": a GGUF's own blocks where they run, else dense
        self.weight_format = _weight_format(cfg.weights, cfg.model_path, self.device, self.dtype)
        t0 = time.perf_counter()
        weights = loader.load(cfg.model_path, self.dtype, self.device, blocks=self.weight_format == "gguf")
        self.model_config = mc = weights.config
        self.weights_file = weights.weights_file
        self.bpw = float(weights.bpw)
        # bytes of weights in device memory; the decode step reads each of them once
        self.weight_bytes = sum(tensor_bytes(t) for t in weights.tensors.values())
        if mc.tie_word_embeddings and "lm_head.weight" not in weights.tensors:
            # the embedding is read twice per step: one row gathered, all of it as lm_head
            self.read_bytes_per_step = self.weight_bytes
        else:
            emb = weights.tensors.get("model.embed_tokens.weight")
            emb_bytes = tensor_bytes(emb) if emb is not None else 0
            self.read_bytes_per_step = self.weight_bytes - emb_bytes  # embedding: a gather
        self.ctx = int(cfg.ctx or mc.max_position_embeddings)
        # --rope-scaling / --rope-scale over the file's own scaling, before anything reads mc
        self.model_config = mc = mc.with_rope_scaling(cfg.rope_scaling, cfg.rope_scale, self.ctx)
        if self.ctx > mc.max_position_embeddings or mc.rope_type is not None:
            plain_past = mc.rope_type is None  # the one case quality is known to drop
            (log.warning if plain_past else log.info)(
                "ctx %d, trained length %d: %s", self.ctx, mc.max_position_embeddings, mc.describe_rope())
        self.num_slots = cfg.slots
        # the scheduler never plans more than max(prefill_chunk, decode rows + 1) tokens;
        # a step of decode rows only has at most one row per slot
        self.max_tokens = cfg.prefill_chunk + cfg.slots
        self.limits = StepLimits(tokens=self.max_tokens, decode_rows=cfg.slots)
        self.decoder = decoder_mod.Decoder(mc, weights.tensors, self.dtype, self.device,
                                           weights=self.weight_format, limits=self.limits)
        del weights
        kv_bytes = kv_cache_mod.KVCache.bytes_for(mc, cfg.slots, self.ctx, self.dtype)
        # the cache is zeroed at start: past the free memory that is an OOM kill mid-load
        # (and a restart loop), not an error a user can read. The host pool is a cap,
        # filled as prefixes are saved, so it is not counted here.
        free = _available_bytes() if self.device.type == "cpu" else None
        if free is not None and kv_bytes > free:
            raise ModelError(f"the KV cache for {cfg.slots} slots x {self.ctx} tokens needs "
                             f"{kv_bytes / 2**30:.1f} GiB; {free / 2**30:.1f} GiB is available "
                             f"after the weights: lower --ctx or --slots")
        self.cache = kv_cache_mod.KVCache(mc, cfg.slots, self.ctx, self.dtype, self.device)
        self.host_pool = kv_cache_mod.HostPool.for_cache(self.cache, cfg.prefix_block,
                                                         cfg.cache_ram_mib * 2**20)
        log.info("model loaded in %.1fs: %s, %s on %s, ctx %d x %d slots (KV cache %.2f GiB)",
                 time.perf_counter() - t0, mc.arch, self.dtype, self.device, self.ctx, cfg.slots,
                 kv_bytes / 2**30)

        self._ids_np = np.zeros(self.max_tokens, dtype=np.int64)  # [max_tokens]
        self._pos_np = np.zeros(self.max_tokens, dtype=np.int64)  # [max_tokens]
        self._ramp = np.arange(self.max_tokens, dtype=np.int64)  # [max_tokens]: a row's positions are start + ramp
        self._ids_host = torch.from_numpy(self._ids_np)
        self._pos_host = torch.from_numpy(self._pos_np)
        if self.device.type == "cpu":
            self._ids_dev, self._pos_dev = self._ids_host, self._pos_host
        else:
            self._ids_dev = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
            self._pos_dev = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
        self.params = np.zeros((cfg.slots, 7), dtype=np.float32)  # [slots, 7]
        self.rng = np.zeros(cfg.slots, dtype=np.uint64)  # [slots]
        self.penalties = np.zeros(cfg.slots, dtype=bool)  # [slots]
        self.num_prompt = np.zeros(cfg.slots, dtype=np.int32)  # [slots]
        self.top_logprobs = np.full(cfg.slots, -1, dtype=np.int32)  # [slots]: top-n, -1 = no logprobs
        # the last sample()'s logprobs, one per sampled row (None for rows without them),
        # or None when no row of that step asked for them
        self.step_logprobs: Optional[list[Optional[TokenLogprob]]] = None

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def admit(self, slot: int, sampling: SamplingParams, num_prompt: int,
              logprobs: Optional[int] = None) -> None:
        """A request took `slot`: its sampling params and a fresh RNG from its seed
        (`logprobs`: GenerationRequest.logprobs, None = off)."""
        self.top_logprobs[slot] = -1 if logprobs is None else logprobs
        self.params[slot] = sampling_row(sampling)
        self.rng[slot] = np.uint64(native.rng_init(sampling.seed))
        self.penalties[slot] = _uses_penalties(sampling)
        self.num_prompt[slot] = num_prompt

    @torch.inference_mode()
    def run(self, plan: StepPlan, slot_tokens: np.ndarray,
            constraints: Optional["ConstraintTable"] = None) -> list[int]:
        """Run one step; returns the sampled ids of the plan's rows with `sample`, in order.

        slot_tokens: int32[slots, ctx+1], the SlotTable's tokens (penalty histories).
        constraints: engine.constraints.ConstraintTable; its masks are computed during the
        forward and applied to the logits before sampling.
        """
        rows = plan.rows
        if constraints is not None and constraints.active:
            constraints.begin([row.request.id for row in rows if row.sample])
        else:
            constraints = None
        if plan.num_tokens > self.max_tokens:
            raise RuntimeError(f"step of {plan.num_tokens} tokens exceeds the buffers ({self.max_tokens})")
        T = 0
        for row in rows:
            n = len(row.token_ids)
            self._ids_np[T : T + n] = row.token_ids
            np.add(self._ramp[:n], row.start, out=self._pos_np[T : T + n])
            T += n
        if self._ids_dev is not self._ids_host:
            self._ids_dev[:T].copy_(self._ids_host[:T], non_blocking=True)
            self._pos_dev[:T].copy_(self._pos_host[:T], non_blocking=True)
        pool = self.host_pool
        for save in plan.saves:
            pool.save(self.cache, save.slot, save.start, save.blocks)
        for src, dst, n in plan.copies:
            # K/V of a prompt prefix another slot computed: [layers, kv_heads, n, head_dim]
            self.cache.k[:, dst, :, :n].copy_(self.cache.k[:, src, :, :n])
            self.cache.v[:, dst, :, :n].copy_(self.cache.v[:, src, :, :n])
        for dst, blocks, n in plan.restores:
            pool.restore(self.cache, dst, blocks, n)
        batch = decoder_mod.Batch(
            input_ids=self._ids_dev[:T],
            positions=self._pos_dev[:T],
            row_slots=[row.slot for row in rows],
            row_starts=[row.start for row in rows],
            row_lens=[len(row.token_ids) for row in rows],
            row_decode=tuple(row.decode for row in rows),
        )
        logits = self.decoder.forward(batch, self.cache)  # [rows, vocab] float32
        pick = [i for i, row in enumerate(rows) if row.sample]
        if not pick:
            return []
        slots = [rows[i].slot for i in pick]
        if len(pick) != len(rows):
            logits = logits[pick]
        logits_np = np.ascontiguousarray(logits.float().cpu().numpy())  # [n, vocab]
        if constraints is not None:
            constraints.apply(logits_np)
        # a row's penalty history: its prompt + the ids sampled before this step
        hist_lens = [len(rows[i].request.token_ids) for i in pick]
        out = self.sample(logits_np, slots, slot_tokens, hist_lens)
        if constraints is not None:
            # rows checked after sampling whose token their grammar refused: masked now,
            # drawn again (they have no penalties and no logprobs: constraints.checks_after)
            again = constraints.check(out, logits_np)
            if again:
                kept = self.step_logprobs
                redrawn = self.sample(logits_np[again], [slots[i] for i in again], slot_tokens,
                                      [hist_lens[i] for i in again])
                self.step_logprobs = kept
                for i, t in zip(again, redrawn):
                    out[i] = t
        return out

    def sample(self, logits: np.ndarray, slots: list[int], slot_tokens: np.ndarray,
               hist_lens: list[int]) -> list[int]:
        """logits: float32[n, vocab] for the rows of `slots`; slot_tokens[s, :hist_lens[i]]
        is row i's history (prompt then generated ids)."""
        n = len(slots)
        params = self.params[slots]  # [n, 7]
        rng = self.rng[slots]  # [n]
        offsets = np.zeros(n + 1, dtype=np.int32)
        gen_start = np.zeros(n, dtype=np.int32)
        hist = _EMPTY_I32
        if self.penalties[slots].any():
            parts = []
            for i, s in enumerate(slots):
                if self.penalties[s]:
                    length = hist_lens[i]
                    parts.append(slot_tokens[s, :length])
                    gen_start[i] = self.num_prompt[s]
                    offsets[i + 1] = offsets[i] + length
                else:
                    offsets[i + 1] = offsets[i]
            hist = np.ascontiguousarray(np.concatenate(parts), dtype=np.int32)
        # the sampler penalises these logits in place: logprobs are read from them after
        logits = np.require(logits, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])
        out = native.sample(logits, params, rng, hist, offsets, gen_start)
        self.rng[slots] = rng
        want = self.top_logprobs[slots]  # [n]
        self.step_logprobs = self._logprobs(logits, out, want) if (want >= 0).any() else None
        return [int(t) for t in out]

    @staticmethod
    def _logprobs(logits: np.ndarray, ids: np.ndarray, want: np.ndarray) -> list[Optional[TokenLogprob]]:
        """Rows with want[i] >= 0: their token's logprob and top want[i]; the others None
        (and never computed)."""
        rows = np.flatnonzero(want >= 0)
        top_n = int(want[rows].max())
        picked = logits if len(rows) == len(want) else logits[rows]  # [k, vocab]
        lp, top_ids, top_lp = native.logprobs(picked, ids[rows], top_n)
        lp = np.maximum(lp, LOGPROB_FLOOR)
        top_lp = np.maximum(top_lp, LOGPROB_FLOOR)
        res: list[Optional[TokenLogprob]] = [None] * len(want)
        for j, i in enumerate(rows.tolist()):
            n = int(want[i])
            res[i] = TokenLogprob(float(lp[j]), tuple(top_ids[j, :n].tolist()), tuple(top_lp[j, :n].tolist()))
        return res

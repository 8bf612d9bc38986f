"""GET /metrics: what the server does, in the Prometheus text exposition format.

Rules:
- Every name starts with `mashbox:`. No label names a user, an API key or a session:
  the only labels are `finished_reason`, the cache layout's `block_size` /
  `num_blocks`, and histogram `le`.
- One source of numbers: `engine.stats()` (the engine client counts every request it
  admits, whichever route sent it); this module only names and formats them.
- Cache layout: one slot holds one whole context, so block_size = ctx and
  num_blocks = slots.
- Prefix cache lookups and hits are counted in tokens: every prompt token is looked up;
  the hits are the prompt tokens served from the cache.
"""
from __future__ import annotations

from mashbox.api.common import OPENAI, ApiContext
from mashbox.engine.interface import HistogramSnapshot
from mashbox.http.response import text_response

PREFIX = "mashbox:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Engine finish reasons -> the metric's finished_reason (EOS and stop strings are "stop").
FINISHED_REASONS = ("stop", "length", "abort", "error")
_ENGINE_TO_METRIC = {"stop": "stop", "stop_sequence": "stop", "length": "length", "cancelled": "abort",
                     "error": "error"}

# metric name -> (EngineStats.histograms key, help)
HISTOGRAMS = (
    ("time_to_first_token_seconds", "time_to_first_token_seconds", "Time from admission to the first new token."),
    ("request_queue_time_seconds", "queue_time_seconds", "Time a request waited for a slot."),
    ("e2e_request_latency_seconds", "e2e_request_latency_seconds", "Time from admission to the final event."),
    ("time_per_output_token_seconds", "time_per_output_token_seconds", "Time per new token after the first."),
)


def _num(x) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return str(x)
    return repr(float(x))


def render(api: ApiContext) -> str:
    stats = api.engine.stats()
    info = api.info
    slots = int(stats.slots or (info.slots if info else 0) or api.engine_config.slots)
    ctx = int(stats.ctx or (info.ctx if info else 0) or api.engine_config.ctx or 0)
    finished = {r: 0 for r in FINISHED_REASONS}
    for reason, n in stats.requests_finished.items():
        finished[_ENGINE_TO_METRIC.get(reason, "error")] += n

    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list) -> None:
        full = PREFIX + name
        lines.append(f"# HELP {full} {help_text}")
        lines.append(f"# TYPE {full} {kind}")
        for labels, value in samples:
            lines.append(f"{full}{labels} {_num(value)}")

    metric("num_requests_running", "gauge", "Requests in a slot (prefilling or decoding).",
           [("", stats.running)])
    metric("num_requests_waiting", "gauge", "Requests waiting for a slot.", [("", stats.waiting)])
    metric("kv_cache_usage_perc", "gauge", "Fraction of the KV cache slots in use (0 to 1).",
           [("", float(stats.kv_cache_usage))])
    metric("cache_config_info", "gauge",
           "KV cache layout: one slot holds one whole context (block_size = ctx, num_blocks = slots).",
           [(f'{{block_size="{ctx}",num_blocks="{slots}"}}', 1)])
    metric("request_success_total", "counter", "Requests finished, by finish reason.",
           [(f'{{finished_reason="{r}"}}', finished[r]) for r in FINISHED_REASONS])
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
           [("", stats.prompt_tokens)])
    metric("generation_tokens_total", "counter", "New tokens generated.",
           [("", stats.generated_tokens)])
    metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           [("", stats.prompt_tokens)])
    metric("prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache "
           "(a slot's or the host memory's).",
           [("", stats.prefix_cache_hit_tokens + stats.host_cache_hit_tokens)])
    metric("host_cache_bytes", "gauge", "Bytes the host memory prompt cache holds (--cache-ram), "
           "snapshots included, each block once.",
           [("", stats.host_cache_bytes + stats.snapshot_bytes)])
    metric("host_cache_capacity_bytes", "gauge", "Most bytes the host memory prompt cache may hold (0 = off).",
           [("", stats.host_cache_cap_bytes)])
    metric("host_cache_hits_total", "counter", "Prompt tokens restored from the host memory prompt cache.",
           [("", stats.host_cache_hit_tokens)])
    metric("host_cache_evictions_total", "counter", "Host memory prompt cache blocks evicted to stay under the cap.",
           [("", stats.host_cache_evictions)])
    metric("prefill_dedupes_total", "counter",
           "Requests that waited for a running prefill of their prompt's prefix instead of computing it again.",
           [("", stats.prefill_dedupes)])
    metric("num_preemptions_total", "counter", "Requests preempted (mashbox never preempts).",
           [("", stats.preemptions)])
    metric("worker_restarts_total", "counter", "Times the worker was started again after a fault.",
           [("", stats.worker_restarts)])
    metric("compiles_after_ready_total", "counter", "Programs compiled after the server reported ready.",
           [("", stats.compiles_after_ready or 0)])

    empty = HistogramSnapshot()
    for name, key, help_text in HISTOGRAMS:
        full = PREFIX + name
        h = stats.histograms.get(key, empty)
        lines.append(f"# HELP {full} {help_text}")
        lines.append(f"# TYPE {full} histogram")
        for le, cum in h.buckets:
            lines.append(f'{full}_bucket{{le="{le}"}} {cum}')
        lines.append(f'{full}_bucket{{le="+Inf"}} {h.count}')
        lines.append(f"{full}_sum {_num(float(h.sum))}")
        lines.append(f"{full}_count {h.count}")
    return "\n".join(lines) + "\n"


def routes(api: ApiContext) -> list:
    async def metrics(req):
        return text_response(render(api), content_type=CONTENT_TYPE)

    return [("GET", "/metrics", metrics, OPENAI)]

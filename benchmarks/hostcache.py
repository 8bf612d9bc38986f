"""The host memory prompt cache (--cache-ram): returning conversations against cold ones.

Scenario (issue 12 item 7): `--slots` 2 and `--convs` 6 conversations of `--tokens`
(4k) prompt tokens each, taken in turn for `--rounds` rounds. Each turn of a
conversation is its previous prompt + the answer it got + a short new user message, so
from round 1 on every conversation returns after the others pushed it out of its slot.
Reported:

- TTFT (the worker's prompt_ms: admission to the first new token) of round 0 (cold) and
  of the returning turns, median of each, and their ratio (goal <= 5%), with cache_n;
- the restore's bandwidth: HostPool.restore of one conversation's K/V into a slot,
  against a plain contiguous copy of the same bytes (the machine's copy bandwidth), in
  this process, on the served model's KV shape;
- memory: host_cache_bytes + snapshot_bytes against host_cache_cap_bytes, and the
  worker's resident memory.

`--cache-ram 0` runs the same turns with the host cache off (the baseline: a returning
conversation is prefilled again, but for what a free slot still holds).

Usage: python benchmarks/hostcache.py [--model PATH] [--tokens 4096] [--rounds 2]
       [--cache-ram 2048] [--threads N] [--device auto] [--bandwidth-only]
Prints the load average beside the figures: measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

# benchmarks/http.py sits next to this file: keep the folder off sys.path so `import http`
# finds the standard library, and put the repo root on it
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from mashbox.config import EngineConfig, GenerationRequest, SamplingParams, ServerConfig  # noqa: E402


def conversation_text(c: int, n_words: int) -> str:
    return " ".join(f"[conv {c}] step {i}: worker {c * 31 + i % 17} read file_{i % 97}.py and found "
                    f"{i % 11} issues." for i in range(n_words // 12 + 1))


def rss_mib(pid) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def turns(client, prompts, rounds: int, max_tokens: int, tok):
    cold, back, cached = [], [], []
    for r in range(rounds + 1):
        for c in range(len(prompts)):
            rid = f"c{c}r{r}"
            h = client.submit(GenerationRequest(id=rid, tenant="bench", prompt_ids=tuple(prompts[c]),
                                                sampling=SamplingParams(), max_tokens=max_tokens,
                                                ignore_eos=True))
            events = [ev async for ev in h]
            final = events[-1]
            if final.finish_reason == "error":
                raise RuntimeError(final.error)
            t = final.timings
            (cold if r == 0 else back).append(t.prompt_ms)
            if r:
                cached.append(t.cache_n / len(prompts[c]))
            answer = [i for ev in events for i in ev.token_ids]
            prompts[c] = prompts[c] + answer + tok.encode(f" Round {r + 1}: and then?")
    return cold, back, cached, client.stats()


def restore_bandwidth(model_path: str, tokens: int, device: str, dtype_name: str):
    """(restore GB/s, plain copy GB/s, bytes) for one conversation of `tokens` tokens."""
    import torch

    from mashbox.model import decoder as decoder_mod
    from mashbox.model import kv_cache, loader
    from mashbox.engine.host_cache import HostCache

    mc = loader.read_config(model_path)
    dev, dtype = decoder_mod.device_and_dtype(device, dtype_name, mc.hidden_size)
    cache = kv_cache.KVCache(mc, 2, tokens + 64, dtype, dev)
    block = 16
    blocks = -(-tokens // block)
    pool = kv_cache.HostPool(cache, block, blocks + 1)
    table = HostCache(blocks + 1, block, kv_cache.HostPool.block_bytes(cache, block), cache.capacity)
    ids = tuple(range(blocks))
    pool.save(cache, 0, 0, ids)
    nbytes = blocks * table.block_bytes
    flat_src = torch.empty(nbytes // cache.k.element_size(), dtype=dtype)
    flat_dst = torch.empty_like(flat_src, device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def best(fn, n=5):
        times = []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_restore = best(lambda: pool.restore(cache, 1, ids, tokens))
    t_copy = best(lambda: flat_dst.copy_(flat_src))
    return nbytes / t_restore / 1e9, nbytes / t_copy / 1e9, nbytes


def print_bandwidth(path: str, args) -> None:
    r_bw, c_bw, nbytes = restore_bandwidth(path, args.tokens, args.device, args.dtype)
    print(f"restore of {nbytes / 2**20:.0f} MiB ({args.tokens} tokens): {r_bw:.1f} GB/s, "
          f"plain copy {c_bw:.1f} GB/s ({r_bw / c_bw:.0%})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the default model)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens per conversation (default 4096)")
    ap.add_argument("--convs", type=int, default=6, help="conversations (default 6)")
    ap.add_argument("--slots", type=int, default=2, help="slots (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="returning rounds after the cold one (default 2)")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer tokens per turn (default 16)")
    ap.add_argument("--cache-ram", type=int, default=2048, help="MiB (default 2048; 0 = off, the baseline)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--bandwidth-only", action="store_true", help="only the restore vs copy bandwidth")
    args = ap.parse_args()

    from mashbox import registry
    from mashbox.engine.client import EngineClient
    from mashbox.text.tokenizer import load_tokenizer

    path = args.model or str(registry.pull(registry.DEFAULT_MODEL_ID))
    if args.bandwidth_only:
        print_bandwidth(path, args)
        print("load average %.2f %.2f %.2f" % os.getloadavg())
        return 0
    tok = load_tokenizer(path)
    prompts = [tok.encode(conversation_text(c, args.tokens))[: args.tokens] for c in range(args.convs)]
    ctx = args.tokens + (args.rounds + 1) * (args.max_tokens + 16) + 64
    cfg = EngineConfig(model_path=path, model_id="bench", slots=args.slots, ctx=ctx, device=args.device,
                       dtype=args.dtype, threads=args.threads, cache_ram_mib=args.cache_ram)

    async def run():
        client = EngineClient(cfg, ServerConfig())
        await client.start()
        try:
            await client.wait_ready(timeout=600)
            out = await turns(client, prompts, args.rounds, args.max_tokens, tok)
            return out + (rss_mib(client.worker_pid),)
        finally:
            await client.stop()

    cold, back, cached, stats, rss = asyncio.run(run())
    load = os.getloadavg()
    c_med, b_med = statistics.median(cold), statistics.median(back)
    print(f"model {os.path.basename(path)}, slots {args.slots}, {args.convs} conversations of "
          f"{args.tokens} tokens, {args.rounds} returning rounds, --cache-ram {args.cache_ram}")
    print(f"TTFT cold median {c_med:.0f} ms, returning median {b_med:.1f} ms: {b_med / c_med:.2%} of cold "
          f"(goal <= 5%); cached {min(cached):.1%}..{max(cached):.1%} of the returning prompts")
    held = stats.host_cache_bytes + stats.snapshot_bytes
    cap = stats.host_cache_cap_bytes
    print(f"memory: host cache {held / 2**20:.0f} MiB held of a {cap / 2**20:.0f} MiB cap "
          f"({stats.host_cache_evictions} evictions, {stats.prefill_dedupes} dedupes); "
          f"worker RSS {rss:.0f} MiB")
    if args.cache_ram:
        print_bandwidth(path, args)
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

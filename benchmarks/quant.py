"""GGUF weights kept in their blocks at a real model's size, side by side with llama.cpp.

For each file (default: random-weight GGUFs of SmolLM2-1.7B's shape in Q8_0 and
Q4_K_M-like form, written once by /work/shared/tools/make_big_gguf.py into --big), one
child process per file and --weights form (default: gguf, the file's own blocks, then
dense bfloat16) loads it and measures, in the same run:

- batch-1 decode and batch-8 aggregate tokens/s (benchmarks/decode.py's decode_rate:
  only steps where every row decodes are timed), a 512-token prefill (one request, one
  step of --prefill tokens) and a --short one (8 tokens, best of 4 a round: a short turn's prompt run, which
  csrc/amx.c takes with the operands swapped);
- the machine's read bandwidth (a sum over a large bfloat16 tensor, decode.py's
  read_bandwidth), and the bound it sets: read bandwidth / bytes the step reads (every
  linear's blocks once, the embedding's rows aside);
- the kernels' bound for 1 and 8 rows: every quantized linear of a step at its kernel's
  rate in cache (one linear's first rows per block type and width, timed alone), the
  read bound's twin for arithmetic. A step near its read bound waits on memory, one
  near its kernel bound on the decode rule's vdpbf16ps (8 rows: 8x the products of 1,
  over the same weights), so b8 / b1 can be no more than kernel bound 8 / b1;
- resident memory: the process's RSS growth over the load (less the KV cache, which
  is zeroed at start; the tokenizer and runtime stay in it) against the file's tensor
  bytes, and the decoder's own weight bytes;
- with --depth N: batch-1 decode after one N-token prompt (each step reads N keys and
  values a layer: the decode attention's share), measured once;
- with LLAMA_BENCH=/path/to/llama-bench: llama.cpp's tg (decode, batch 1) and pp
  (prefill, -p PREFILL,SHORT) on the same file with -t THREADS, and mashbox's ratios to them
  (with --depth, its tg after -d N too).

The `quant:` line per file is the result:

    quant: <file> b1 <tok/s> (<x>% of read bound <tok/s>; kernel bound <tok/s>) |
           b8 <tok/s> (<r>x b1; kernel bound <tok/s>: <r>x b1) |  (no kernel bound: dense)
           pp<N> <tok/s> | pp<S> <tok/s> | [b1@<D> <tok/s> |] rss <MB> / tensors <MB> (<r>x) |
           llama.cpp tg <..> pp <..> pp<S> <..> | b1 <r>x llama.cpp, pp <r>x, pp<S> <r>x

The load average is printed beside every figure: on a shared machine only the ratios
measured in one quiet run mean anything.

--kernels: the legacy block kernels alone (csrc/quant.c), no model, no engine. For each
format one decode step's linears of SmolLM2-1.7B's shape (--layers of them: q|k|v, o,
gate|up, down; random blocks) from memory, out of cache, on ONE thread, timed in process
CPU time (best of 5), against the dense bfloat16 kernel on the same shapes: a busy
machine's other processes then cost little, while two threads lose a scheduler slice at
every fork/join whose worker is descheduled (seen at load 3-5: 8-12 ms a call for a
0.2 ms kernel, which is what made whole steps look 5-10x slow). One line per format:

    kernel Q8_0 m=1: 4 layers 20.6 ms, 285 MB, 13.9 GB/s (1.00x dense's GB/s, 1.78x its speed)

Usage: python benchmarks/quant.py [FILE.gguf ...] [--big /work/big] [--tokens 32]
       [--prefill 512] [--short 8] [--threads 2] [--repeat 2] [--depth 2048]
       python benchmarks/quant.py --kernels [--layers 4] [--rows 1]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

MAKE_BIG = "/work/shared/tools/make_big_gguf.py"
FILES = {"Q8_0": "smollm2-1.7b-q8_0.gguf", "Q4_K_M": "smollm2-1.7b-q4_k_m.gguf"}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _ensure(big: str, kind: str) -> str:
    """The big file of `kind`, written once (make_big_gguf.py) when it is not there."""
    path = os.path.join(big, FILES[kind])
    if not os.path.exists(path):
        from mashbox import registry

        os.makedirs(big, exist_ok=True)
        src = str(registry.pull(registry.DEFAULT_MODEL_ID, quiet=True))
        print(f"writing {path} ({kind}) with {MAKE_BIG} ...", flush=True)
        subprocess.run([sys.executable, MAKE_BIG, src, path + ".part", "--type", kind], check=True)
        os.replace(path + ".part", path)
    return path


def _fresh_ids(tag: str, tokens: int) -> tuple:
    """`tokens` prompt ids for a request tagged `tag`: any ids (speed does not depend on
    them), but another prompt per tag: a repeated one would be served from the prefix
    cache and time almost nothing."""
    first = 1000 + (sum(map(ord, tag)) * 7919) % 20000
    return tuple(range(first, first + tokens))


def _prefill_rate(engine, tokens: int, tag: str) -> float:
    """Prompt tokens/s of one request of `tokens` tokens (one step at prefill_chunk >= tokens)."""
    from mashbox.config import GenerationRequest, SamplingParams

    engine.submit(GenerationRequest(id=tag, tenant="bench", prompt_ids=_fresh_ids(tag, tokens),
                                    sampling=SamplingParams(temperature=0.0), max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    return tokens / (time.perf_counter() - t0)


def _depth_rate(engine, depth: int, tokens: int, tag: str) -> float:
    """Batch-1 decode tokens/s after a `depth`-token prompt (every step reads its keys and
    values in each layer): one request, only the steps where it decodes timed."""
    from mashbox.config import GenerationRequest, SamplingParams

    engine.submit(GenerationRequest(id=tag, tenant="bench", prompt_ids=_fresh_ids(tag, depth),
                                    sampling=SamplingParams(temperature=0.0), max_tokens=tokens, ignore_eos=True))
    steps, seconds = 0, 0.0
    while engine.has_work:
        decoding = any(r.state.value == "decoding" for r in engine.scheduler.running.values())
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            steps, seconds = steps + 1, seconds + time.perf_counter() - t0
    return steps / seconds


def _quant_linears(decoder) -> list:
    """Every QuantLinear a decode step runs: the layers' (a QkvSplit's two parts) and the head."""
    from mashbox.model.linear import QkvSplit, QuantLinear

    found = []
    for lin in [x for L in decoder.layers for x in (L.qkv, L.o, L.gate_up, L.down)] + [decoder.lm_head]:
        found.extend((lin.qk, lin.v) if isinstance(lin, QkvSplit) else [lin] if isinstance(lin, QuantLinear) else [])
    return found


def _kernel_bound(decoder, rows: int, cache_bytes: int = 4 << 20) -> float:
    """Tokens/s of `rows` decode rows if every quantized linear of a step ran at its kernel's
    rate in cache (0.0 when the step has none): per (block type, in) one linear's first
    rows, up to cache_bytes of blocks (4 MB: two threads' shares sit in their L2s, and a
    call is long enough that the thread pool's start and join cost little), timed alone on
    the step's threads, best of 30. Attention, norms and dense linears are not
    counted, so this is a ceiling on what the decode rule computes, the read bound's twin:
    a step below it waits on memory, one near it on the kernels' arithmetic."""
    import torch

    from mashbox import native
    from mashbox.model import csrc

    lins = _quant_linears(decoder)
    rate: dict = {}  # (qtype, k) -> weights per second
    for lin in lins:
        key = (lin.qtype, lin.k)
        if key in rate:
            continue
        n = max(16, min(lin.n, cache_bytes // lin.blocks.shape[1]) // 16 * 16)
        w = lin.blocks[:n].contiguous()
        x = torch.randn(rows, lin.k).bfloat16()
        y = torch.empty(rows, n, dtype=torch.float32)
        best = float("inf")
        for _ in range(30):
            t0 = time.perf_counter()
            csrc.q_linear(lin.qtype, w, n, lin.k, x, None, y, native.Y_F32, lin.kernel)
            best = min(best, time.perf_counter() - t0)
        rate[key] = n * lin.k / best
    step = sum(lin.n * lin.k / rate[(lin.qtype, lin.k)] for lin in lins)
    return rows / step if step else 0.0


def measure(path: str, weights: str, tokens: int, prefill: int, short: int, threads: int, repeat: int,
            depth: int = 0) -> dict:
    """One file in this process: what the `quant:` line reports, as a dict."""

    from benchmarks.decode import ForwardTimer, decode_rate, read_bandwidth
    from mashbox.config import EngineConfig
    from mashbox.engine.worker import Engine
    from mashbox.model.gguf_weights import GGUFWeights

    tensor_bytes = GGUFWeights(path).nbytes
    rss0 = _rss()
    engine = Engine(EngineConfig(model_path=path, model_id="bench", slots=8, ctx=max(256, prefill + 16, depth + tokens + 16),
                                 threads=threads, prefill_chunk=max(512, prefill), weights=weights, dtype="bfloat16"))
    gc.collect()
    r = engine.runner
    kv_bytes = sum(t.numel() * t.element_size() for t in (r.cache.k, r.cache.v))
    rss1 = _rss() - kv_bytes  # the KV cache is zeroed (touched) at start; not a weight
    ForwardTimer(r.decoder)
    decode_rate(engine, 1, 4, "warm")
    b1 = b8 = pp = pps = bw = 0.0
    loads = []
    for i in range(repeat):  # the best round of each: other load only ever slows one down
        bw = max(bw, read_bandwidth())
        b1 = max(b1, decode_rate(engine, 1, tokens, f"b1r{i}")[0])
        b8 = max(b8, decode_rate(engine, 8, tokens, f"b8r{i}")[0])
        pp = max(pp, _prefill_rate(engine, prefill, f"ppr{i}"))
        # a short prefill is one ~0.2 s step: one sample is at the mercy of a scheduler
        # slice, so the best of a few
        pps = max([pps] + [_prefill_rate(engine, short, f"pps{i}.{j}") for j in range(4)])
        loads.append(os.getloadavg()[0])
    # one long prompt's prefill takes a minute at this size: once, not once a round
    bd = _depth_rate(engine, depth, tokens, "depth") if depth else 0.0
    c1, c8 = _kernel_bound(r.decoder, 1), _kernel_bound(r.decoder, 8)
    return dict(file=path, weights=r.weight_format, b1=b1, b8=b8, pp=pp, prefill=prefill, pps=pps, short=short,
                depth=depth, bd=bd,
                read_bw=bw, read_bytes=r.read_bytes_per_step, weight_bytes=r.weight_bytes, rss=rss1 - rss0,
                tensor_bytes=tensor_bytes, load=max(loads), c1=c1, c8=c8)


def kernels(layers: int, rows: int, formats: str = "") -> None:
    """--kernels: see the module's docstring."""
    import numpy as np
    import torch

    from mashbox import native, native_ref
    from mashbox.model import csrc, linear

    torch.set_num_threads(1)
    shapes = [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * layers
    rng = np.random.default_rng(0)
    xs = {k: torch.randn(rows, k).bfloat16() for k in (2048, 8192)}
    ys = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in shapes}
    half = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)

    def best(step) -> float:
        step()
        t = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            step()
            t = min(t, time.process_time() - t0)
        return t

    dense = [linear.BF16Linear(torch.randn(n, k).bfloat16() * 0.02) for n, k in shapes]
    t_dense = best(lambda: [w(xs[w.k]) for w in dense])
    dense_bytes = sum(2 * n * k for n, k in shapes)
    dense.clear()
    print(f"kernel bf16 m={rows}: {layers} layers {t_dense * 1e3:.1f} ms, {dense_bytes / 1e6:.0f} MB, "
          f"{dense_bytes / t_dense / 1e9:.1f} GB/s | load {os.getloadavg()[0]:.1f}", flush=True)
    wanted = {getattr(native, f) for f in formats.split(",")} if formats else set(native.Q_LEGACY)
    for qtype in [t for t in native.Q_LEGACY if t in wanted]:
        nbytes, m_at = native_ref.Q_FORMATS[qtype]
        ws = []
        for n, k in shapes:
            w = rng.integers(0, 256, (n, k // 32, nbytes), dtype=np.uint8)
            w[:, :, 0:2] = half
            if m_at is not None:
                w[:, :, m_at:m_at + 2] = half
            ws.append(w.reshape(n, -1))

        def step() -> None:
            for (n, k), w in zip(shapes, ws):
                native.q_linear_ptr(qtype, w.ctypes.data, w.shape[1], n, k, xs[k].data_ptr(), k, rows, 0,
                                    ys[n].data_ptr(), native.Y_BF16, n, native.bf16_kernel(), csrc.parallel(), 1)

        t = best(step)
        total = sum(w.nbytes for w in ws)
        name = next(nm for nm, v in vars(native).items() if v == qtype and nm.startswith("Q") and "_" in nm)
        print(f"kernel {name} m={rows}: {layers} layers {t * 1e3:.1f} ms, {total / 1e6:.0f} MB, "
              f"{total / t / 1e9:.1f} GB/s ({total / t / (dense_bytes / t_dense):.2f}x dense's GB/s, "
              f"{t_dense / t:.2f}x its speed) | load {os.getloadavg()[0]:.1f}", flush=True)
        ws.clear()


def llama_bench(binary: str, path: str, tokens: int, prefill: int, short: int,
                threads: int) -> tuple[float, float, float]:
    """(tg, pp at `prefill`, pp at `short`) tokens/s of llama-bench on the file."""
    out = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", f"{prefill},{short}", "-n", str(tokens),
                          "-r", "2", "-o", "json"], check=True, capture_output=True, text=True).stdout
    tg, pp = 0.0, {}
    for row in json.loads(out):
        if row.get("n_gen", 0) > 0:
            tg = float(row["avg_ts"])
        elif row.get("n_prompt", 0) > 0:
            pp[int(row["n_prompt"])] = float(row["avg_ts"])
    return tg, pp.get(prefill, 0.0), pp.get(short, 0.0)


def llama_bench_depth(binary: str, path: str, tokens: int, depth: int, threads: int) -> float:
    """llama-bench's tg tokens/s after a `depth`-token context (-d), one repetition (its
    prefill of the context is most of the run)."""
    out = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", "0", "-n", str(tokens), "-d", str(depth),
                          "-r", "1", "-o", "json"], check=True, capture_output=True, text=True).stdout
    return next(float(row["avg_ts"]) for row in json.loads(out) if row.get("n_gen", 0) > 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", help="GGUF files (default: the Q8_0 and Q4_K_M big files under --big)")
    ap.add_argument("--big", default="/work/big", help="where the default files are written once and reused")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per request (llama-bench -n)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill (llama-bench -p)")
    ap.add_argument("--short", type=int, default=8, help="prompt tokens of the short prefill (a turn's few new ones)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (llama-bench -t)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds; the best of each figure counts")
    ap.add_argument("--depth", type=int, default=0,
                    help="also batch-1 decode after a prompt of this many tokens (llama-bench -d), once; 0: not")
    ap.add_argument("--weights", default="gguf,dense",
                    help="the --weights forms to measure, comma-separated, each in its own child process")
    ap.add_argument("--kernels", action="store_true", help="the legacy block kernels alone, one thread, out of cache")
    ap.add_argument("--layers", type=int, default=4, help="--kernels: layers of the 1.7B shape per step")
    ap.add_argument("--rows", type=int, default=1, help="--kernels: rows (batch) per call")
    ap.add_argument("--formats", default="", help="--kernels: formats to time, comma-separated (default: all legacy)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one file, a JSON line out
    args = ap.parse_args()
    if args.kernels:
        kernels(args.layers, args.rows, args.formats)
        return 0
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.weights, args.tokens, args.prefill, args.short,
                                             args.threads, args.repeat, args.depth)))
        return 0
    files = args.files or [_ensure(args.big, kind) for kind in FILES]
    bench = os.environ.get("LLAMA_BENCH")
    for path, weights in [(p, w) for p in files for w in args.weights.split(",")]:
        argv = ["--one", path, "--weights", weights, "--tokens", str(args.tokens), "--prefill", str(args.prefill),
                "--short", str(args.short), "--threads", str(args.threads), "--repeat", str(args.repeat),
                "--depth", str(args.depth)]
        child = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True)
        lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
        if child.returncode or not lines:
            print(f"quant: {path} failed (exit {child.returncode}):\n{child.stderr[-2000:]}")
            continue
        m = json.loads(lines[-1][len("RESULT "):])
        bound = m["read_bw"] / m["read_bytes"]
        # dense weights have no quantized linear to time: no kernel bound
        c1 = f"; kernel bound {m['c1']:.1f}" if m["c1"] else ""
        c8 = f"; kernel bound {m['c8']:.1f}: {m['c8'] / m['b1']:.1f}x b1" if m["c8"] else ""
        line = (f"quant: {os.path.basename(path)} (weights {m['weights']}) b1 {m['b1']:.1f} tok/s "
                f"({100 * m['b1'] / bound:.0f}% of read bound {bound:.1f}: {m['read_bw'] / 1e9:.1f} GB/s over "
                f"{m['read_bytes'] / 1e6:.0f} MB a step{c1}) | b8 {m['b8']:.1f} ({m['b8'] / m['b1']:.1f}x b1{c8}) | "
                f"pp{m['prefill']} {m['pp']:.1f} tok/s | pp{m['short']} {m['pps']:.1f} tok/s | "
                + (f"b1@{m['depth']} {m['bd']:.1f} tok/s | " if m["depth"] else "")
                + f"rss {m['rss'] / 1e6:.0f} MB, weights "
                f"{m['weight_bytes'] / 1e6:.0f} MB / tensors {m['tensor_bytes'] / 1e6:.0f} MB "
                f"({m['rss'] / m['tensor_bytes']:.2f}x) | load {m['load']:.1f}")
        if bench and weights == args.weights.split(",")[0]:
            tg, pp, pps = llama_bench(bench, path, args.tokens, args.prefill, args.short, args.threads)
            line += (f" | llama.cpp tg{args.tokens} {tg:.1f} pp{args.prefill} {pp:.1f} pp{args.short} {pps:.1f} "
                     f"(load {os.getloadavg()[0]:.1f}) | b1 {m['b1'] / tg:.2f}x llama.cpp, pp {m['pp'] / pp:.2f}x, "
                     f"pp{args.short} {m['pps'] / pps:.2f}x")
            if args.depth:
                td = llama_bench_depth(bench, path, args.tokens, args.depth, args.threads)
                line += f" | llama.cpp tg{args.tokens}@d{args.depth} {td:.1f}: b1@{args.depth} {m['bd'] / td:.2f}x"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

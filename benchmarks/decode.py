"""Decode throughput of the default model at batch 1, 4 and 8, against the memory-bandwidth bound.

Runs the engine in process (the same Engine the worker runs: scheduler, runner, native
sampling, detokenization). Each batch size gets B requests with short prompts and
ignore_eos; only steps where every row decodes are timed. In the same run, a large
tensor copy measures the memory bandwidth; a decode step must read every weight byte
once (the tied embedding as the output head), so

    bound tokens/s (batch 1) = copy bandwidth / weight bytes read per step

where copy bandwidth counts bytes read + bytes written. The `decode:` line is the result:

    decode: b1 <tok/s> (<x>% of bound <tok/s>) | b4 <tok/s> | b8 <tok/s> (<r>x b1) | ...

and a last line pairs each round's b1 with copies measured just before and after it.

Usage: python benchmarks/decode.py [--model PATH] [--tokens 48] [--dtype auto] [--repeat 3]
       [--profile]   (adds a torch profiler table of one batch-1 and one batch-8 step)
       [--weights auto|gguf|dense|int8|int4]   (auto, the server's default: a GGUF's
       own blocks wherever they run, else dense; int8 / int4: opt-in weight-only quantized linears,
       bf16 on CPU, whose bound stays the dense model's, so int4 can pass 100%)
       [--linears own|onednn]   (bf16 dense linears on mashbox's kernel, the default where
       the CPU has AVX512-BF16, or on oneDNN, for a side-by-side)
       [--decode c|loop|sdpa]   (decode steps' layers in one C call with csrc's attention,
       the default where it runs; `loop`: the same calls made from Python's layer loop;
       `sdpa`: that loop with decode attention on SDPA)

Besides the copy bandwidth (the bound), the same run measures a read-only stream (a sum
over a large bfloat16 tensor): decode only reads weights, and on this project's CPU a
read stream moves fewer bytes per second than a copy's read + write, so the second
ratio says how close the step comes to what its reads alone could do.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# the repository root instead of this folder: benchmarks/http.py would shadow the stdlib
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks import engine_rate  # noqa: E402
from mashbox import native  # noqa: E402
from mashbox.config import GenerationRequest, SamplingParams  # noqa: E402
from mashbox.engine.worker import Engine  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works.",
    "List ten fruits and their colours.",
    "What is the history of the printing press?",
    "Describe a walk through a forest in autumn.",
    "How do airplanes stay in the air?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
]


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5, device: str = "cpu") -> float:
    """Bytes per second (read + written) of the best of `reps` large tensor copies."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 5, device: str = "cpu") -> float:
    """Bytes per second of the best of `reps` sums over a large bfloat16 tensor."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        src.sum()
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


class ForwardTimer:
    """Wraps the decoder's forward to tell the model's time from the engine's own."""

    def __init__(self, decoder) -> None:
        self.inner = decoder.forward
        self.seconds = 0.0
        decoder.forward = self

    def __call__(self, batch, cache):
        t0 = time.perf_counter()
        out = self.inner(batch, cache)
        self.seconds += time.perf_counter() - t0
        return out


def decode_rate(engine: Engine, batch: int, tokens: int, tag: str) -> tuple[float, float, float]:
    """(aggregate tokens/s, mean step seconds, mean forward seconds) over steps where all
    `batch` rows decode."""
    timer = engine.runner.decoder.forward
    rate = engine_rate.decode_rate(engine, PROMPTS, batch, tokens, tag, clock=lambda: timer.seconds)
    return rate.tok_s, rate.step_s, rate.clock_s


def profile_step(engine: Engine, batch: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    tok = engine.tokenizer
    for i in range(batch):
        engine.submit(GenerationRequest(
            id=f"prof{batch}-{i}", tenant="bench", prompt_ids=tuple(tok.encode(PROMPTS[i])),
            sampling=SamplingParams(), max_tokens=12, ignore_eos=True))
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            engine.step()
    while engine.has_work:
        engine.step()
    print(f"--- profile: 4 decode steps at batch {batch} ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the default model)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds of b1, b4, b8 (interleaved); the best round of each counts, "
                         "since on a shared machine other load only ever slows a round down")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--weights", default="auto", choices=("auto", "gguf", "dense", "int8", "int4"))
    ap.add_argument("--linears", default="own", choices=("own", "onednn"))
    ap.add_argument("--decode", default="c", choices=("c", "loop", "sdpa"))
    args = ap.parse_args()
    path = engine_rate.model_path(args.model)
    engine = engine_rate.make_engine(path, dtype=args.dtype, device=args.device, threads=args.threads)
    r = engine.runner
    if args.weights != "auto" or args.linears != "own" or args.decode != "c":
        # rebuild the runner's decoder in place with the asked-for linears
        from mashbox.model import loader
        from mashbox.model.decoder import Decoder
        from mashbox.model.kernels import Kernels

        del r.decoder
        fmt = r.weight_format if args.weights == "auto" else args.weights
        w = loader.load(path, r.dtype, r.device, blocks=fmt == "gguf")
        r.decoder = Decoder(w.config, w.tensors, r.dtype, r.device, weights=fmt, limits=r.limits,
                            kernels=Kernels(linears="auto" if args.linears == "own" else "onednn",
                                            attention="sdpa" if args.decode == "sdpa" else "auto",
                                            layers="auto" if args.decode == "c" else "python"))
    ForwardTimer(r.decoder)
    decode_rate(engine, 1, 8, "warm")  # warm-up: first-call costs, caches
    rates, steps, fwd = {1: 0.0, 4: 0.0, 8: 0.0}, {}, {}
    bw = read_bw = 0.0
    # each round also pairs its own b1 rate with copies measured right before and after
    # it: on a shared machine the bandwidth can change from one minute to the next, and
    # the best rate and the best bandwidth of a run may come from different moments
    paired: list[tuple[float, float]] = []  # (b1 % of the round's bound, b8 / b1 of the round)
    for i in range(args.repeat):
        round_rates = {}
        before = copy_bandwidth(device=r.device.type, reps=3)
        for b in (1, 4, 8):
            rate, step, f = decode_rate(engine, b, args.tokens, f"b{b}r{i}")
            round_rates[b] = rate
            if b == 1:
                after = copy_bandwidth(device=r.device.type, reps=3)
            if rate > rates[b]:
                rates[b], steps[b], fwd[b] = rate, step, f
        round_bound = (before + after) / 2 / r.read_bytes_per_step
        paired.append((100 * round_rates[1] / round_bound, round_rates[8] / round_rates[1]))
        bw = max(bw, before, after, copy_bandwidth(device=r.device.type))
        read_bw = max(read_bw, read_bandwidth(device=r.device.type))
    bound = bw / r.read_bytes_per_step
    read_bound = read_bw / r.read_bytes_per_step
    print(f"model {os.path.basename(path)}: {r.model_config.arch}, {r.dtype} on {r.device}, "
          f"{r.weight_bytes / 1e6:.0f} MB weights, {r.read_bytes_per_step / 1e6:.0f} MB read per step "
          f"(as loaded: weights {r.weight_format}; decoder weights {r.decoder.weights}; linears "
          f"{r.decoder.kernels.linears}; decode layers {r.decoder.kernels.layers}, attention "
          f"{r.decoder.kernels.attention}; kernel {r.decoder.kernels.kernel}); "
          f"native sampler: {'C' if native.NATIVE else 'Python reference'}; threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(f"copy bandwidth {bw / 1e9:.2f} GB/s (read + write) -> bound {bound:.1f} steps/s; "
          f"read bandwidth {read_bw / 1e9:.2f} GB/s -> {read_bound:.1f} steps/s")
    for b in (1, 4, 8):
        print(f"batch {b}: {rates[b]:.1f} tok/s aggregate, {steps[b] * 1e3:.1f} ms/step "
              f"(model forward {fwd[b] * 1e3:.1f} ms, engine: plan, sampling, detok {(steps[b] - fwd[b]) * 1e3:.2f} ms)")
    print(f"decode: b1 {rates[1]:.1f} tok/s ({100 * rates[1] / bound:.0f}% of bound {bound:.1f}) | "
          f"b4 {rates[4]:.1f} tok/s ({rates[4] / rates[1]:.1f}x b1) | "
          f"b8 {rates[8]:.1f} tok/s ({rates[8] / rates[1]:.1f}x b1) | "
          f"targets: b1 >= 60% of bound, b8 >= 4x b1 | b1 is {100 * rates[1] / read_bound:.0f}% of the read-only bound")
    pct = sorted(p[0] for p in paired)
    ratio = sorted(p[1] for p in paired)
    print(f"per round (b1 against copies just before and after it): b1 "
          f"{', '.join(f'{p:.0f}%' for p, _ in paired)} of bound (median {pct[len(pct) // 2]:.0f}%) | "
          f"b8/b1 {', '.join(f'{q:.1f}x' for _, q in paired)} (median {ratio[len(ratio) // 2]:.1f}x)")
    if args.profile:
        profile_step(engine, 1)
        profile_step(engine, 8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

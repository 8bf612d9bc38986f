"""Long-prompt prefill of the default model: Claude-Code-shaped prompts of 5k, 10k, 20k
and 30k tokens, against llama-server's prefill of the same GGUF when LLAMA_SERVER is set.

Starts `python -m mashbox run MODEL --ctx 32768 --slots 1` (and, with LLAMA_SERVER=path
to a llama-server binary, `llama-server -m MODEL -t THREADS -c 32768 --jinja -np 1
--override-kv ARCH.context_length=int:32768`: it caps a slot at the trained length,
8192 for the default model, otherwise), then for
each size sends one request to each server: POST /v1/chat/completions with max_tokens 1
and the same body, shaped as Claude Code's first request (../shared/spec/clients.md):
a system prompt that starts with a per-request billing header (so no prefix cache can
serve it) and lists tools with long descriptions and JSON Schemas, a user turn with a
<system-reminder>. The tools are repeated (with new names) until the prompt has about
the size asked for (the slope of two short requests' prompt tokens decides how many). Both servers answer with llama-server's `timings` block;
prompt_n / prompt_ms is the prefill speed. Prints one line per size and server:

    prefill <size>: mashbox <prompt_n> tokens <seconds> s <tok/s> tok/s | llama-server ... | <x>x

and the load average beside each (a busy machine's figures are not the machine's), then
the same as one markdown table (prompt size, tokens, seconds, tok/s per server, the ratio).

Usage: python benchmarks/prefill.py [--model PATH] [--sizes 5000,10000,20000,30000]
       [--ctx 32768] [--threads 2] [--prefill-chunk N] [--timeout 1800]
       [--profile]   (in process, no servers: where a prefill's time goes; below)

--profile times one prefill chunk's forward of the default model (bfloat16, the kernels a
server picks) at key offsets 0 .. 30k, and the attention alone of that chunk (every layer's
call on the prompt path the decoder picked: csrc's prefill kernel, or SDPA on a CPU with
AMX; then on SDPA as the decoder runs it), so that

    profile chunk 512 at <offset>: forward <ms> = attention <ms> + the rest <ms> | sdpa attention <ms>

and from those a 20k-token prompt's estimated prefill time in chunks of 256 .. 2048
(attention grows with the offset, the rest does not).
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]  # benchmarks/http.py
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402

from mashbox import gguf_meta, registry  # noqa: E402

TOOL_NAMES = ("Task", "Bash", "Glob", "Grep", "LS", "ExitPlanMode", "Read", "Edit", "MultiEdit", "Write",
              "NotebookEdit", "WebFetch", "TodoWrite", "WebSearch", "BashOutput", "KillShell", "SlashCommand",
              "AskUser", "ListMcpResources", "ReadMcpResource", "Skill", "Monitor", "Diff", "Plan")

DESCRIPTION = (
    "Executes a given command in a persistent shell session with optional timeout, ensuring proper "
    "handling and security measures. Before executing the command, please follow these steps: verify "
    "the parent directory exists, quote paths that contain spaces, and prefer the dedicated tools for "
    "searching and reading files over shell commands. Usage notes: the command argument is required; "
    "you can specify an optional timeout in milliseconds (up to 600000ms / 10 minutes); it is very "
    "helpful if you write a clear, concise description of what this command does in 5-10 words; if the "
    "output exceeds 30000 characters, output will be truncated before being returned to you. When "
    "issuing multiple commands, use the ';' or '&&' operator to separate them. Try to maintain your "
    "current working directory throughout the session by using absolute paths and avoiding cd. ")


def _tool(name: str, i: int) -> dict:
    props = {f"{field}_{i}": {"type": kind, "description": f"The {field} to use for {name} ({i}); "
                              + DESCRIPTION[:160]}
             for field, kind in (("path", "string"), ("pattern", "string"), ("limit", "integer"),
                                 ("offset", "integer"), ("recursive", "boolean"))}
    return {"type": "function", "function": {
        "name": f"{name}{i}" if i else name, "description": f"{name}: " + DESCRIPTION * 2,
        "parameters": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                       "properties": props, "required": list(props)[:2], "additionalProperties": False}}}


def body(tools: int, model: str) -> dict:
    """The request: the tools are written into the system prompt as JSON (as a template
    with tools renders them), not sent as `tools`: llama-server's rendering of the default
    model's template drops a `tools` field, so both servers get the same text this way."""
    specs = [_tool(TOOL_NAMES[i % len(TOOL_NAMES)], i // len(TOOL_NAMES)) for i in range(tools)]
    system = (f"x-anthropic-billing-header: cc_version=2.1; cch={uuid.uuid4().hex};\n"
              "You are Claude Code, Anthropic's official CLI for Claude. You are an interactive CLI tool "
              "that helps users with software engineering tasks. " + DESCRIPTION * 6
              + "\n\n# Tools\n\nYou may call one or more of these functions:\n<tools>\n"
              + "\n".join(json.dumps(t) for t in specs) + "\n</tools>")
    user = ("<system-reminder>\nAs you answer the user's questions, you can use the following context: "
            "# important-instruction-reminders\nDo what has been asked; nothing more, nothing less.\n"
            + DESCRIPTION * 8 + "\n</system-reminder>\n\nPlease look at the failing test in tests/ and fix it.")
    return {"model": model, "max_tokens": 1, "temperature": 0, "stream": False,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def post(port: int, path: str, payload: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(payload).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("server not ready in time")


def model_id(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def tools_for(port: int, size: int, timeout: float) -> int:
    """Tools that bring the prompt to about `size` tokens: two short requests (0 and 8
    tools, their prompt tokens as the server's usage counts them) give the slope."""
    counts = []
    for n in (0, 8):
        counts.append(post(port, "/v1/chat/completions", body(n, model_id(port)), timeout)["usage"]["prompt_tokens"])
    per_tool = (counts[1] - counts[0]) / 8
    return max(0, round((size - counts[0]) / per_tool))


def prefill(port: int, tools: int, timeout: float) -> tuple[int, float]:
    """(prompt_n, seconds) of one request, from the server's timings."""
    answer = post(port, "/v1/chat/completions", body(tools, model_id(port)), timeout)
    t = answer["timings"]
    return int(t["prompt_n"]), float(t["prompt_ms"]) / 1000.0


def start(cmd: list[str], port: int, log_name: str) -> subprocess.Popen:
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), log_name), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def profile(args) -> None:
    import math

    import torch
    import torch.nn.functional as F

    from mashbox.model import csrc, loader
    from mashbox.model.decoder import Batch, Decoder
    from mashbox.model.kv_cache import KVCache, key_width

    torch.set_num_threads(args.threads)
    model = args.model or str(registry.pull(registry.DEFAULT_MODEL_ID))
    w = loader.load(model, torch.bfloat16, torch.device("cpu"))
    c = w.config
    dec = Decoder(c, w.tensors, torch.bfloat16, "cpu")
    cache = KVCache(c, slots=1, ctx=args.ctx, dtype=torch.bfloat16, device=torch.device("cpu"))
    cache.k.normal_(), cache.v.normal_()  # keys as a prompt would leave them (values do not change the time)
    H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
    G = H // KV
    print(f"profile: {model} kernels {dec.kernels} threads {args.threads}", flush=True)

    def best(fn, reps=2):
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    def forward(n, start):
        ids = torch.randint(0, c.vocab_size, (n,)).tolist()
        return best(lambda: dec.forward(Batch.build([(0, start, ids)]), cache))

    def att(n, start, own):
        q = torch.randn(n, H * D).bfloat16()
        out = torch.empty(n, H * D, dtype=torch.bfloat16)
        k, v = cache.k[0], cache.v[0]
        if own:
            rows = [torch.tensor([x], dtype=torch.int64) for x in (0, 0, start, n)]
            return best(lambda: [csrc.prefill_attention(q, *rows, H, KV, 0, 1 / math.sqrt(D), k, v, out,
                                                        dec.kernels.kernel) for _ in range(c.num_layers)])
        keys = key_width(start + n)
        qpos = torch.arange(start, start + n).unsqueeze(1)
        mask = torch.zeros(n, keys, dtype=torch.bfloat16).masked_fill_(
            torch.arange(keys).unsqueeze(0) > qpos, float("-inf")).expand(G, n, keys).reshape(1, 1, G * n, keys)
        qr = q.view(n, KV, G, D).permute(1, 2, 0, 3).reshape(1, KV, G * n, D)
        return best(lambda: [F.scaled_dot_product_attention(qr, k[:1, :, :keys], v[:1, :, :keys], attn_mask=mask)
                             for _ in range(c.num_layers)], reps=1)

    own = dec.kernels.prefill == "csrc"  # the prompt rows' attention the forward ran (SDPA on AMX)
    n = 512
    fits = {}
    for start in [s for s in (0, 5000, 10000, 20000, 30000) if s + n <= args.ctx]:
        f, a = forward(n, start), att(n, start, own)
        sd = att(n, start, False)
        fits[start] = (f, a)
        print(f"profile chunk {n} at {start}: forward {f * 1e3:.0f} ms = attention {a * 1e3:.0f} ms "
              f"+ the rest {(f - a) * 1e3:.0f} ms | sdpa attention {sd * 1e3:.0f} ms   "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    # attention per query grows with its keys: a per key-query rate from the longest offset
    far = max(fits)
    rate = fits[far][1] / (n * (far + n / 2))
    for chunk in (256, 512, 1024, 2048):
        rest = forward(chunk, 0) - att(chunk, 0, own)
        total = sum(rest * min(chunk, 20000 - s0) / chunk + rate * min(chunk, 20000 - s0) * (s0 + chunk / 2)
                    for s0 in range(0, 20000, chunk))
        print(f"profile 20k prompt in chunks of {chunk}: ~{total:.0f} s (the rest {rest / chunk * 20000:.0f} s, "
              f"attention {rate * 20000 ** 2 / 2:.0f} s)   (load average {os.getloadavg()[0]:.1f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a .gguf file (default: the default model, pulled)")
    ap.add_argument("--sizes", default="5000,10000,20000,30000")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=0, help="mashbox's --prefill-chunk (0: its default)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one request may take")
    ap.add_argument("--profile", action="store_true", help="in process: where a chunk's time goes")
    args = ap.parse_args()
    if args.profile:
        profile(args)
        return
    model = args.model or str(registry.pull(registry.DEFAULT_MODEL_ID))
    sizes = [int(s) for s in args.sizes.split(",")]
    servers: list[tuple[str, subprocess.Popen, int]] = []
    try:
        port = free_port()
        cmd = [sys.executable, "-m", "mashbox", "run", model, "--ctx", str(args.ctx), "--slots", "1",
               "--port", str(port), "--threads", str(args.threads), "--log-level", "warning"]
        if args.prefill_chunk:
            cmd += ["--prefill-chunk", str(args.prefill_chunk)]
        servers.append(("mashbox", start(cmd, port, "prefill-mashbox.log"), port))
        llama = os.environ.get("LLAMA_SERVER")
        if llama:
            lport = free_port()
            # llama-server caps a slot's context at the GGUF's trained length (8192 for the
            # default model) unless the file's context_length is overridden
            arch = gguf_meta.read(model, tensors=False).get("general.architecture", "llama")
            servers.append(("llama-server", start([llama, "-m", model, "-t", str(args.threads), "-c", str(args.ctx),
                                                   "--jinja", "--port", str(lport), "-np", "1", "--override-kv",
                                                   f"{arch}.context_length=int:{args.ctx}"],
                                                  lport, "prefill-llama.log"), lport))
        for _, proc, p in servers:
            wait_ready(p, proc, 600)
        # one tool count for every server: mashbox's tokens decide it
        plan = {size: tools_for(servers[0][2], size, args.timeout) for size in sizes}
        table = []
        for size in sizes:
            parts, speeds, cells = [], [], []
            for name, _, p in servers:
                try:
                    n, secs = prefill(p, plan[size], args.timeout)
                except urllib.error.HTTPError as exc:
                    raise SystemExit(f"{name} answered {exc.code} at {size} tokens: {exc.read()[:300]!r}") from None
                speeds.append(n / secs)
                parts.append(f"{name} {n} tokens {secs:.1f} s {n / secs:.0f} tok/s")
                cells += [f"{n}", f"{secs:.1f}", f"{n / secs:.0f}"]
            ratio = f" | {speeds[0] / speeds[1]:.2f}x" if len(speeds) > 1 else ""
            load = os.getloadavg()[0]
            print(f"prefill {size}: " + " | ".join(parts) + ratio + f"   (load average {load:.1f})", flush=True)
            table.append([f"{size}"] + cells + ([f"{speeds[0] / speeds[1]:.2f}x"] if len(speeds) > 1 else [])
                         + [f"{load:.1f}"])
        head = ["prompt"] + [f"{name} {col}" for name, _, _ in servers for col in ("tokens", "s", "tok/s")]
        head += (["vs llama-server"] if len(servers) > 1 else []) + ["load avg"]
        print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for row in table:
            print("| " + " | ".join(row) + " |")
    finally:
        for _, proc, _ in servers:
            proc.terminate()
        for _, proc, _ in servers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()

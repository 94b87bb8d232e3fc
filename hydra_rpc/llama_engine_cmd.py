"""``hydra-llama-engine`` (and ``hydra-rpc llama-engine``): started exactly as a Hydra node agent
starts the fork's ``llama-engine``, so a node's ``binary:`` can point here unchanged.

The whole command line is llama-engine's (docs/llama-args.md): ``--host``, ``--port`` (the
HTTP side), ``--rpc-port`` (the Hydra port; default ``--port`` + 1), ``--ggml-rpc-port``, then
llama-server's arguments and their ``LLAMA_ARG_*`` variables. An argument llama-server would
refuse ends the process with its message and status 1, as llama-server does; one without
effect here is listed once at startup and in INFO ``ignored_args``.
"""
from __future__ import annotations

import sys

from .config import ServerConfig
from .llama_args import BY_NAME, status
from .llama_argv import InvalidArgument, LlamaEngineSettings, parse_llama_argv
from .llama_cli import announce_ignored, apply_process_priority, engine_config
from .logs import setup_logging
from .serve_cmd import run_app, run_loop, startup_failure_of
from .usage import UsageError, version_string

PROG = "hydra-llama-engine"
EXIT_INVALID = 1  # llama-server's status for an invalid command line


def build_app(s: LlamaEngineSettings):
    from engine.model_files import resolve_model

    from .app import App

    if not s.model:
        raise UsageError("error: --model is required (router mode is not implemented)")
    try:
        model = str(resolve_model(s.model))
    except (OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"error: failed to load model '{s.model}': {e}") from None
    host = s.host[0]
    scfg = ServerConfig(host=host, port=s.hydra_port(), ggml_rpc_port=s.ggml_rpc_port, http_metrics=s.metrics,
                        http_slots=s.slots, http_timeout=float(s.timeout))
    app = App(scfg, engine_config(s, model, loop_realtime=True), http_host=host, http_port=s.port,
              info_extra={"ignored_args": [a.as_dict() for a in s.ignored_args]})
    announce_ignored(s, PROG)
    apply_process_priority(s)
    return app


def usage() -> str:
    lines = [f"usage: {PROG} --model FILE [--host H] [--port HTTP] [--rpc-port HYDRA] [llama-server arguments]", "",
             __doc__.strip(), "", "Arguments applied here:"]
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
        s = parse_llama_argv(argv)
    except InvalidArgument as e:
        print(e, file=sys.stderr, flush=True)
        return EXIT_INVALID
    if s.action == "help":
        print(usage())
        return 0
    if s.action == "version":
        print(version_string())
        return 0
    setup_logging("text", "INFO")
    try:
        app = build_app(s)
        where = f"{s.host[0]} (--port {s.port}, --rpc-port {s.hydra_port()}, --ggml-rpc-port {s.ggml_rpc_port})"
        return run_loop(run_app(app, lambda e: startup_failure_of(e, where)), "uvloop")
    except UsageError as e:
        print(f"{PROG}: {e}", file=sys.stderr, flush=True)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

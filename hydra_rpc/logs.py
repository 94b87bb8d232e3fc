"""Structured logging: one line per request, text or JSON lines."""
from __future__ import annotations

import json
import logging
import sys
import time

log = logging.getLogger("hydra_rpc")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return base


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("hydra_rpc")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    eng = logging.getLogger("engine")
    eng.handlers[:] = [handler]
    eng.setLevel(level.upper())
    eng.propagate = False


def log_request(*, op: str, key: str, trace: str, status: str, req_bytes: int, resp_bytes: int,
                started: float, peer: str, conn: int) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    log.info("request", extra={"fields": {
        "op": op, "key": key, "trace": trace, "status": status, "req_bytes": req_bytes,
        "resp_bytes": resp_bytes, "ms": round((time.perf_counter() - started) * 1000, 3),
        "peer": peer, "conn": conn}})

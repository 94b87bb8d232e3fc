"""Rendering messages: one-line summaries, the ``-V`` field tree, ``-x`` hex dumps, NDJSON.

Renderers return strings and never print (scapy's ``_show_or_dump``): the CLI decides where the
text goes, and colour is a parameter the CLI turns on only for a terminal.
"""
from __future__ import annotations

import json
from typing import Any, Iterator

from .model import ERROR, WARN, Field, Message
from .util import compact, human, jsonable

RESET = "\x1b[0m"
COLOURS = {"hydra": "\x1b[36m", "ggml": "\x1b[35m", "raw": "\x1b[33m", ERROR: "\x1b[31m", WARN: "\x1b[33m",
           "dim": "\x1b[2m", "bold": "\x1b[1m"}
JSON_FIELDS_PRETTY_LINES = 60


class Renderer:
    def __init__(self, *, colour: bool = False, t0: float | None = None):
        self.colour = colour
        self.t0 = t0

    def c(self, key: str, s: str) -> str:
        return f"{COLOURS[key]}{s}{RESET}" if self.colour and key in COLOURS else s

    def _time(self, m: Message) -> str:
        if m.ts_first is None:
            return " " * 10
        if self.t0 is None:
            self.t0 = m.ts_first
        return f"{m.ts_first - self.t0:10.6f}"

    # ---- one line per message (default) ----------------------------------------------------
    def summary(self, m: Message) -> str:
        proto = self.c(m.proto, f"{m.proto.upper():5}")
        pair = ""
        if m.peer is not None:
            if m.direction == "request":
                pair = f" [reply #{m.peer.number}]" if m.peer.number else ""
            else:
                lat = m.latency_ms
                pair = f" [#{m.peer.number}" + (f", {lat:.3f} ms" if lat is not None else "") + "]"
        worst = _worst(m)
        text = m.summary or "(no summary)"
        if worst == ERROR or (m.direction == "response" and _status_bad(m)):
            text = self.c(ERROR, text)
        flag = ""
        if not m.complete:
            flag = self.c(WARN, " [incomplete]")
        elif worst:
            flag = self.c(worst, f" [{len(m.notes)} note{'s' if len(m.notes) > 1 else ''}]")
        # client on the left, server on the right, the arrow shows who sent it
        ends = f"{m.src} → {m.dst}" if m.direction == "request" else f"{m.dst} ← {m.src}"
        return (f"{m.number:5} {self._time(m)} s{m.stream:<3} {ends} {proto} "
                f"{text} {human(m.length)}{pair}{flag}")

    # ---- -V ------------------------------------------------------------------------------
    def tree(self, m: Message) -> str:
        lines = [self.c("bold", f"#{m.number} stream {m.stream} {m.direction} {m.src} → {m.dst}, "
                                f"{m.length} bytes at stream offset {m.stream_offset}"
                                + _frames(m)
                                + (f", t={m.ts_first - self.t0:.6f}" if m.ts_first is not None and self.t0 is not None
                                   else ""))]
        lines.append(f"{m.proto.upper()} {m.direction}: {m.summary}")
        for f in m.fields:
            lines.extend(self._field_lines(f, 1))
        for sev, text in m.notes:
            lines.append("    " + self.c(sev, f"[expert {sev}] {text}"))
        if m.peer is not None:
            lat = m.latency_ms
            what = "response" if m.direction == "request" else "request"
            lines.append(f"    [{what} in #{m.peer.number}" + (f", latency {lat:.3f} ms" if lat is not None else "")
                         + (f", time to first byte {m.ttfb_ms:.3f} ms" if m.ttfb_ms is not None else "") + "]")
        return "\n".join(lines)

    def _field_lines(self, f: Field, depth: int) -> Iterator[str]:
        pad = "    " * depth
        where = self.c("dim", f"[{f.offset}:{f.offset + f.length}]")
        if isinstance(f.value, (dict, list)) and not f.children and f.show is not None and f.show == compact(f.value):
            pretty = json.dumps(jsonable(f.value), indent=2, ensure_ascii=False).splitlines()
            yield f"{pad}{f.name}: {where}"
            for ln in pretty[:JSON_FIELDS_PRETTY_LINES]:
                yield f"{pad}    {ln}"
            if len(pretty) > JSON_FIELDS_PRETTY_LINES:
                yield f"{pad}    … {len(pretty) - JSON_FIELDS_PRETTY_LINES} more lines"
            return
        yield f"{pad}{f.name}: {f.display()} {where}"
        for c in f.children:
            yield from self._field_lines(c, depth + 1)

    # ---- -x ------------------------------------------------------------------------------
    def hexdump(self, m: Message) -> str:
        out = [f"{off:04x}  {hx:<47}  {asc}" for off, hx, asc in hexdump_rows(m.data)]
        if m.length > len(m.data):
            out.append(f"      … {m.length - len(m.data)} more bytes not shown")
        return "\n".join(out)


def hexdump_rows(data: bytes, width: int = 16) -> Iterator[tuple[int, str, str]]:
    """``(offset, hex, ascii)`` rows (mitmproxy's ``strutils.hexdump`` shape)."""
    for off in range(0, len(data), width):
        chunk = data[off : off + width]
        yield off, chunk.hex(" "), "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)


def _worst(m: Message) -> str | None:
    sevs = {s for s, _ in m.notes}
    return ERROR if ERROR in sevs else WARN if WARN in sevs else None


def _status_bad(m: Message) -> bool:
    st = m.attrs.get("status")
    return st is not None and int(st) != 0


def message_json(m: Message) -> dict[str, Any]:
    """One NDJSON record: position, pairing, filterable attributes and the field tree."""
    attrs = dict(m.peer.attrs) if m.peer is not None else {}
    for k in list(attrs):
        if k not in ("op", "cmd", "key", "trace", "status", "dialect", "error"):
            del attrs[k]
    attrs.update({k: v for k, v in m.attrs.items() if v is not None or k not in attrs})
    out: dict[str, Any] = {
        "number": m.number, "stream": m.stream, "proto": m.proto, "direction": m.direction,
        "src": m.src, "dst": m.dst, "stream_offset": m.stream_offset, "length": m.length,
        "declared_length": m.declared_length, "complete": m.complete, "ts": m.ts_first, "ts_last": m.ts_last,
        "frame": m.frame_first, "frame_last": m.frame_last, "summary": m.summary,
    }
    for k, v in attrs.items():
        out[k] = jsonable(v)
        if k in ("op", "cmd", "status") and isinstance(v, int):
            out[f"{k}_code"] = int(v)
    out["pair"] = m.peer.number if m.peer is not None else None
    out["latency_ms"] = m.latency_ms
    out["ttfb_ms"] = m.ttfb_ms
    out["notes"] = [{"severity": s, "text": t} for s, t in m.notes]
    out["fields"] = [jsonable(f.to_json()) for f in m.fields]
    return out


def ndjson(m: Message) -> str:
    return json.dumps(message_json(m), ensure_ascii=False, separators=(",", ":"), default=str)


def _frames(m: Message) -> str:
    if not m.frame_first:
        return ""
    if m.frame_last in (None, m.frame_first):
        return f", frame {m.frame_first}"
    return f", frames {m.frame_first}–{m.frame_last}"

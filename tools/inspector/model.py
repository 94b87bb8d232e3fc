"""What the dissectors produce: messages made of a field tree with byte offsets.

A :class:`Field` is one decoded item: a dotted name in Wireshark's ``proto.field`` style
(``hydra.op``, ``ggml.tensor.name``), a JSON-able value, an optional display string, and
where its bytes are — ``offset`` and ``length`` relative to the start of the message.
Renderers, filters and the NDJSON writer all read this one structure.

A :class:`Message` is one PDU (a request, a response, or undecodable bytes) of one TCP
stream direction, with where it was in the stream and in the capture, the expert notes the
dissector attached, and its request/response partner once both are known.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

# Expert note severities, as Wireshark's expert info levels.
NOTE = "note"
WARN = "warn"
ERROR = "error"


@dataclass(slots=True)
class Field:
    name: str
    value: Any
    offset: int
    length: int
    show: str | None = None  # how to display the value; default: str(value)
    children: list[Field] = field(default_factory=list)

    def add(self, name: str, value: Any, offset: int, length: int, show: str | None = None) -> Field:
        child = Field(name, value, offset, length, show)
        self.children.append(child)
        return child

    def display(self) -> str:
        return self.show if self.show is not None else _short(self.value)

    def walk(self) -> Iterator[Field]:
        yield self
        for c in self.children:
            yield from c.walk()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "value": self.value, "offset": self.offset, "length": self.length}
        if self.show is not None:
            out["show"] = self.show
        if self.children:
            out["children"] = [c.to_json() for c in self.children]
        return out


def _short(value: Any) -> str:
    if isinstance(value, bytes):
        return value[:32].hex(" ") + (" …" if len(value) > 32 else "")
    if isinstance(value, str):
        return repr(value) if len(value) <= 120 else repr(value[:120]) + "…"
    return str(value)


@dataclass(slots=True)
class Message:
    proto: str  # "hydra", "ggml" or "raw"
    direction: str  # "request" (client → server) or "response"
    stream: int
    stream_offset: int  # of the message's first byte in its direction's byte stream
    length: int = 0  # bytes of the message that were on the wire (seen or missing)
    declared_length: int | None = None  # what the headers said the message would be
    ts_first: float | None = None
    ts_last: float | None = None
    frame_first: int | None = None  # capture frame numbers (1-based), None when live/hex
    frame_last: int | None = None
    src: str = ""
    dst: str = ""
    fields: list[Field] = field(default_factory=list)
    data: bytes = b""  # the first bytes of the message, for -x
    summary: str = ""
    notes: list[tuple[str, str]] = field(default_factory=list)  # (severity, text)
    attrs: dict[str, Any] = field(default_factory=dict)  # filterable values (op, key, status, …)
    peer: Message | None = None  # the request of a response, the response of a request
    number: int = 0  # position in the output, set by the session's consumer
    complete: bool = True  # False: the stream ended (or was cut) before the declared end

    def add(self, name: str, value: Any, offset: int, length: int, show: str | None = None) -> Field:
        f = Field(name, value, offset, length, show)
        self.fields.append(f)
        return f

    def note(self, text: str, severity: str = WARN) -> None:
        self.notes.append((severity, text))

    def walk(self) -> Iterator[Field]:
        for f in self.fields:
            yield from f.walk()

    @property
    def latency_ms(self) -> float | None:
        """Request's first byte → response's last byte: the round trip a client sees."""
        req, resp = (self, self.peer) if self.direction == "request" else (self.peer, self)
        if req is None or resp is None or req.ts_first is None or resp.ts_last is None:
            return None
        return (resp.ts_last - req.ts_first) * 1000.0

    @property
    def ttfb_ms(self) -> float | None:
        """Request's last byte → response's first byte: the time the server took to answer."""
        req, resp = (self, self.peer) if self.direction == "request" else (self.peer, self)
        if req is None or resp is None or req.ts_last is None or resp.ts_first is None:
            return None
        return (resp.ts_first - req.ts_last) * 1000.0

    def filter_values(self) -> dict[str, Any]:
        """Everything ``-Y`` can test: own attributes, the partner's where this one has none
        (a request's status is its response's), and every field by its dotted name."""
        values: dict[str, Any] = {
            "proto": self.proto, "direction": self.direction, "stream": self.stream, "size": self.length,
            "complete": self.complete, "frame": self.frame_first, "src": self.src, "dst": self.dst,
            "number": self.number, "notes": len(self.notes),
        }
        # The partner's attributes first, so a request answers ``status`` and a response
        # ``op``/``key``; the message's own non-empty values win.
        merged = dict(self.peer.attrs) if self.peer is not None else {}
        for k, v in self.attrs.items():
            if v is not None or k not in merged:
                merged[k] = v
        values.update(merged)
        lat = self.latency_ms
        if lat is not None:
            values["latency"] = values["latency_ms"] = lat
        for f in self.walk():
            values.setdefault(f.name, f.value)
        return values

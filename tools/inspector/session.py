"""Streams → protocols → messages: the part shared by file mode, the live tap and ``--hex``.

Each TCP stream's protocol is recognised from the client's first bytes (docs/protocol.md §1, §14):
``59 48`` is Hydra, ``0E`` is a ggml-RPC HELLO, any other byte below ``0x14`` a pre-HELLO ggml
client; anything else is shown raw. ``--decode-as`` decides for streams that do not start at
the beginning (no SYN) or start with something else, and ``--port`` forces it for streams to
those server ports. Events that arrive before the decision are held and replayed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from codec.ggml import classify_first_bytes

from .ggml_dissect import GgmlStream
from .hydra_dissect import HydraStream
from .model import NOTE, WARN, Message
from .reassembly import StreamData, StreamEnd, StreamGap, StreamOpen
from .util import human

MiB = 1024 * 1024
UNDECIDED_LIMIT = 64 * 1024  # server bytes held while waiting for the client's first bytes


@dataclass
class Options:
    keep: int = 64 * MiB  # bytes of each message kept for decoding
    hex_keep: int = 4096  # bytes of each message kept for -x
    server_ports: frozenset[int] = frozenset()
    decode_as: str | None = None  # "hydra" / "ggml"
    ggml_version: tuple[int, int, int] | None = None
    ggml_fork: str | None = None
    one_direction: bool = False  # --hex/--raw: only one side exists, so nothing pairs


@dataclass
class StreamInfo:
    id: int
    client: str
    server: str
    server_port: int
    syn_seen: bool
    proto: str | None = None
    dissector: object | None = None
    held: list[tuple] = field(default_factory=list)
    head: bytes = b""  # the client's first bytes
    held_bytes: int = 0
    ended: set[str] = field(default_factory=set)


def endpoint_str(ep: tuple[str, int]) -> str:
    host, port = ep
    if port == 0:  # --hex/--raw: no addresses, just the roles
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RawStream:
    """A stream of an unrecognised protocol: one message per direction, at its end."""

    proto = "raw"

    def __init__(self, info: StreamInfo, emit: Callable[[Message], None], hex_keep: int, why: str):
        self.info, self._emit, self.hex_keep, self.why = info, emit, hex_keep, why
        self._msgs: dict[str, Message] = {}

    def _msg(self, direction: str, ts: float | None, frame: int | None) -> Message:
        m = self._msgs.get(direction)
        if m is None:
            req = direction == "c2s"
            m = Message("raw", "request" if req else "response", self.info.id, 0, ts_first=ts, frame_first=frame,
                        src=self.info.client if req else self.info.server, dst=self.info.server if req else self.info.client)
            self._msgs[direction] = m
        return m

    def data(self, direction: str, data: bytes, ts: float | None, frame: int | None) -> None:
        m = self._msg(direction, ts, frame)
        if len(m.data) < self.hex_keep:
            m.data += data[: self.hex_keep - len(m.data)]
        m.length += len(data)
        m.ts_last, m.frame_last = ts, frame

    def gap(self, direction: str, length: int, ts: float | None, frame: int | None) -> None:
        m = self._msg(direction, ts, frame)
        m.length += length
        m.complete = False

    def end(self, direction: str, ts: float | None, frame: int | None) -> None:
        m = self._msgs.pop(direction, None)
        if m is None or m.length == 0:
            return
        m.add("raw.data", m.data[:64], 0, m.length, show=f"{human(m.length)}: {m.data[:16].hex(' ')}")
        m.summary = f"{human(m.length)} of an unrecognised protocol: {m.data[:16].hex(' ')}" + _guess(m.data)
        m.note(self.why, NOTE)
        self._emit(m)


def _guess(head: bytes) -> str:
    if head[:4] in (b"GET ", b"POST", b"PUT ", b"HTTP", b"HEAD", b"DELE"):
        return " (HTTP?)"
    if head[:1] == b"\x16":
        return " (TLS?)"
    if head[:4] == b"SSH-":
        return " (SSH)"
    return ""


class Session:
    def __init__(self, opts: Options, emit: Callable[[Message], None]):
        self.opts = opts
        self._emit = emit
        self.streams: dict[int, StreamInfo] = {}
        self.order: list[int] = []

    def emit(self, msg: Message) -> None:
        self._emit(msg)

    # ---- reassembly events ---------------------------------------------------------------
    def handle(self, ev: object) -> None:
        if isinstance(ev, StreamData):
            self.data(ev.stream, ev.direction, ev.data, ev.ts, ev.frame)
        elif isinstance(ev, StreamGap):
            self.gap(ev.stream, ev.direction, ev.length, ev.ts, ev.frame)
        elif isinstance(ev, StreamEnd):
            self.end(ev.stream, ev.direction, ev.ts, ev.frame)
        elif isinstance(ev, StreamOpen):
            self.open(ev.stream, ev.client, ev.server, ev.syn_seen)

    # ---- direct interface (tap, hex) -----------------------------------------------------
    def open(self, stream: int, client: tuple[str, int], server: tuple[str, int], syn_seen: bool = True,
             proto: str | None = None) -> None:
        info = StreamInfo(stream, endpoint_str(client), endpoint_str(server), server[1], syn_seen)
        self.streams[stream] = info
        self.order.append(stream)
        forced = proto
        if forced is None and self.opts.decode_as and server[1] in self.opts.server_ports:
            forced = self.opts.decode_as
        if forced:
            self._decide(info, forced, "")

    def data(self, stream: int, direction: str, data: bytes, ts: float | None, frame: int | None = None) -> None:
        info = self.streams[stream]
        if info.dissector is None:
            info.held.append(("data", direction, data, ts, frame))
            if direction == "c2s" and len(info.head) < 2:
                info.head += data[: 2 - len(info.head)]
            else:
                info.held_bytes += len(data)
            self._try_decide(info)
            return
        info.dissector.data(direction, data, ts, frame)

    def gap(self, stream: int, direction: str, length: int, ts: float | None, frame: int | None = None) -> None:
        info = self.streams[stream]
        if info.dissector is None:
            info.held.append(("gap", direction, length, ts, frame))
            if direction == "c2s" and len(info.head) < 2:
                self._try_decide(info, force=True)
            return
        info.dissector.gap(direction, length, ts, frame)

    def end(self, stream: int, direction: str, ts: float | None, frame: int | None = None) -> None:
        info = self.streams[stream]
        info.ended.add(direction)
        if info.dissector is None:
            info.held.append(("end", direction, ts, frame))
            if direction == "c2s" or len(info.ended) == 2:
                self._try_decide(info, force=True)
            return
        info.dissector.end(direction, ts, frame)

    def finish(self) -> None:
        for sid in list(self.order):
            info = self.streams[sid]
            for d in ("c2s", "s2c"):
                if d not in info.ended:
                    self.end(sid, d, None, None)

    # ---- protocol decision ---------------------------------------------------------------
    def _try_decide(self, info: StreamInfo, force: bool = False) -> None:
        kind = classify_first_bytes(info.head)
        if kind == "incomplete" and not force and info.held_bytes < UNDECIDED_LIMIT:
            return
        fallback = self.opts.decode_as
        if kind == "hydra":
            self._decide(info, "hydra", "")
        elif kind in ("ggml", "ggml_legacy"):
            self._decide(info, "ggml", "pre-HELLO ggml-RPC client" if kind == "ggml_legacy" else "")
        elif fallback:
            self._decide(info, fallback, f"decoded as {fallback} (--decode-as)")
        elif not info.syn_seen and info.head:
            self._decide(info, "raw", "the capture did not see this connection start and its first bytes are "
                                      "not a Hydra or ggml-RPC header: try --decode-as hydra|ggml")
        else:
            self._decide(info, "raw", f"first bytes {info.head.hex(' ') or '(none)'} are neither Hydra (59 48) "
                                      "nor ggml-RPC (0E)")

    def _decide(self, info: StreamInfo, proto: str, why: str) -> None:
        o = self.opts
        common = dict(keep=o.keep, hex_keep=o.hex_keep, client=info.client, server=info.server)
        if proto == "hydra":
            d: object = HydraStream(info.id, self._tagged(why), pairing=not o.one_direction, **common)
        elif proto == "ggml":
            d = GgmlStream(info.id, self._tagged(why), version=o.ggml_version, fork=o.ggml_fork, **common)
        else:
            d = RawStream(info, self.emit, o.hex_keep, why)
        info.proto, info.dissector = proto, d
        held, info.held = info.held, []
        for ev in held:
            kind, direction, *rest = ev
            getattr(d, kind)(direction, *rest)

    def _tagged(self, why: str) -> Callable[[Message], None]:
        """An emitter that attaches ``why`` (how the protocol was chosen) to the stream's first message."""
        if not why:
            return self.emit
        pending = [why]

        def emit(msg: Message) -> None:
            if pending:
                msg.note(pending.pop(), WARN)
            self.emit(msg)

        return emit

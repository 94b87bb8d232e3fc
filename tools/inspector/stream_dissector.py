"""What the stream dissectors of both protocols share (``hydra_dissect.HydraStream`` and
``ggml_dissect.GgmlStream``): one dispatch of a direction's bytes to its PDU reader, one way a
finished PDU becomes a Message, and one guard that turns a dissector bug into a note."""
from __future__ import annotations

from typing import Any, Callable

from .model import ERROR, Message
from .pdu import UNTIL_EOF, DirectionReader, Pdu
from .util import human


class StreamDissector:
    """What the stream dissectors of both protocols share (GgmlStream uses it too): each
    direction's bytes go to that direction's PDU reader, each finished PDU becomes one Message,
    and a bug in a dissector becomes a note on its message instead of ending the capture."""

    proto: str
    stream: int
    hex_keep: int
    client: str
    server: str
    req: DirectionReader
    resp: DirectionReader

    # ---- session interface ---------------------------------------------------------------
    def reader(self, direction: str) -> DirectionReader:
        return self.req if direction == "c2s" else self.resp

    def data(self, direction: str, data: bytes, ts: float | None, frame: int | None) -> None:
        self.reader(direction).feed(data, ts, frame)

    def gap(self, direction: str, length: int, ts: float | None, frame: int | None) -> None:
        self.reader(direction).gap(length, ts, frame)

    def end(self, direction: str, ts: float | None, frame: int | None) -> None:
        self.reader(direction).end(ts, frame)

    # ---- messages ------------------------------------------------------------------------
    def _base(self, pdu: Pdu, direction: str) -> Message:
        src, dst = (self.client, self.server) if direction == "request" else (self.server, self.client)
        return Message(self.proto, direction, self.stream, pdu.start, length=pdu.seen,
                       declared_length=None if pdu.declared in (None, UNTIL_EOF) else pdu.declared,
                       ts_first=pdu.ts_first, ts_last=pdu.ts_last, frame_first=pdu.frame_first,
                       frame_last=pdu.frame_last, src=src, dst=dst, data=bytes(pdu.kept[: self.hex_keep]),
                       complete=not (pdu.ended_early or pdu.missing or pdu.junk))

    @staticmethod
    def _dissect_guarded(msg: Message, dissect: Callable[..., None], *args: Any) -> None:
        try:
            dissect(msg, *args)
        except Exception as e:  # a dissector bug must not stop the capture (scapy's Raw fallback)
            msg.note(f"dissector error: {type(e).__name__}: {e}", ERROR)

    @staticmethod
    def _show_raw(msg: Message, pdu: Pdu, note: str, summary: str) -> None:
        """Bytes that did not parse as the protocol: shown as they are, the reason as an error."""
        msg.proto = "raw"
        msg.add("raw.data", bytes(pdu.kept[:64]), 0, pdu.seen,
                show=f"{human(pdu.seen)}: {bytes(pdu.kept[:16]).hex(' ')}")
        msg.note(note, ERROR)
        msg.summary = summary
        msg.complete = False

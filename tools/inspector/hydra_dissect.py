"""Hydra over one TCP stream: cut requests and responses, pair them, decode them.

Requests start with the 16-byte header (magic ``59 48``); responses with the 12-byte one
(no magic). Hydra is strictly one request at a time per connection, so the n-th response
answers the n-th request (FIFO). The pairing is known when a response *header* arrives,
which matters for one dialect: PIN DECODE answers ``OK, meta 0, payload 0`` and then streams
``[u32 len][piece]`` frames until the connection closes, so the response reader switches to
"until EOF" when ``codec.dialects.pin_stream_follows`` says so for the request it answers.

After a bad request header (bad magic: the C++ closes, but a capture of a desynced client
shows what followed) the reader looks for the next plausible header: magic, a known opcode,
flags 0, key and trace under 4 KiB. Responses have no magic; their resync needs a status
byte ≤ 6 and a meta that starts with ``{``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from codec.dialects import Dialect, pin_stream_follows
from codec.enums import Op, Status, op_name, status_name
from codec.framing import (MAGIC_BYTES, REQUEST_HEADER, REQUEST_HEADER_SIZE, RESPONSE_HEADER, RESPONSE_HEADER_SIZE,
                           RequestHeader, decode_request_header, decode_response_header)

from . import hydra_payloads as HP
from .layout import construct_fields
from .model import ERROR, NOTE, WARN, Message
from .pdu import UNTIL_EOF, DirectionReader, Pdu
from .stream_dissector import StreamDissector
from .util import Named, compact, human, text

KNOWN_OPS = frozenset(int(o) for o in Op)


def _request_header(raw: bytes) -> RequestHeader:
    """The codec's struct twin of REQUEST_HEADER (callers have checked the magic already)."""
    return decode_request_header(raw)
RESYNC_MAX_PREAMBLE = 4096


def show_value(name: str, v: Any) -> str | None:
    if name == "hydra.op":
        return f"{op_name(v)} (0x{v:02x})"
    if name == "hydra.status":
        return f"{status_name(v)} (0x{v:02x})"
    if name == "hydra.magic":
        return f"0x{v:04x}" + (" (\"YH\")" if v == 0x4859 else " (bad magic: want 0x4859, bytes 59 48)")
    if name in ("hydra.payload_len", "hydra.meta_len") and isinstance(v, int) and v >= 1024:
        return f"{v} ({human(v)})"
    return None


class RequestReader(DirectionReader):
    header_size = REQUEST_HEADER_SIZE
    resyncs = True

    def __init__(self, emit: Callable[[Pdu], None], keep: int, on_request_header: Callable[[Pdu], None]):
        super().__init__(emit, keep)
        self.on_request_header = on_request_header

    def on_header(self, pdu: Pdu, header: bytes) -> bool:
        if header[:2] != MAGIC_BYTES:
            pdu.info["reason"] = f"bad magic {header[:2].hex(' ')} (want 59 48)"
            return False
        h = _request_header(header)
        pdu.info.update(header=h, op=h.op, key_len=h.key_len, trace_len=h.trace_len, payload_len=h.payload_len)
        pdu.declared = REQUEST_HEADER_SIZE + h.key_len + h.trace_len + h.payload_len
        self.on_request_header(pdu)
        return True

    def next_candidate(self, buf: bytearray, pos: int) -> int:
        i = buf.find(MAGIC_BYTES[:1], pos)
        return len(buf) if i < 0 else i

    def plausible_at(self, buf: bytearray, pos: int) -> bool | None:
        if len(buf) - pos < REQUEST_HEADER_SIZE:
            return None if bytes(buf[pos : pos + 2]) in (MAGIC_BYTES, MAGIC_BYTES[:1]) else False
        if bytes(buf[pos : pos + 2]) != MAGIC_BYTES:
            return False
        h = _request_header(bytes(buf[pos : pos + REQUEST_HEADER_SIZE]))
        return (h.op in KNOWN_OPS and h.flags == 0 and h.key_len <= RESYNC_MAX_PREAMBLE
                and h.trace_len <= RESYNC_MAX_PREAMBLE)


class ResponseReader(DirectionReader):
    header_size = RESPONSE_HEADER_SIZE
    resyncs = True

    def __init__(self, emit: Callable[[Pdu], None], keep: int, on_response_header: Callable[[Pdu], bool]):
        super().__init__(emit, keep)
        self.on_response_header = on_response_header

    def on_header(self, pdu: Pdu, header: bytes) -> bool:
        h = decode_response_header(header)
        if h.status > max(Status):
            # No server sends other statuses: this is not a header but a desync — typically the
            # C++ engine's STATE_GET error text written after a NOT_FOUND header (docs/protocol.md §6.3).
            pdu.info["reason"] = (f"status byte 0x{h.status:02x} is not a Hydra status: bytes outside any "
                                  f"response (e.g. the C++ STATE_GET error text {header[:12]!r}, docs/protocol.md §6.3)")
            return False
        pdu.info.update(header=h, status=h.status, meta_len=h.meta_len, payload_len=h.payload_len)
        pdu.declared = RESPONSE_HEADER_SIZE + h.meta_len + h.payload_len
        pdu.start_hash(RESPONSE_HEADER_SIZE + h.meta_len)
        if self.on_response_header(pdu):
            pdu.declared = UNTIL_EOF
            pdu.info["pin_stream"] = True
        return True

    def next_candidate(self, buf: bytearray, pos: int) -> int:
        # A resync needs meta JSON right after the header: jump to the next '{'.
        i = buf.find(b"{", pos + RESPONSE_HEADER_SIZE)
        return max(pos, len(buf) - RESPONSE_HEADER_SIZE) if i < 0 else i - RESPONSE_HEADER_SIZE

    def plausible_at(self, buf: bytearray, pos: int) -> bool | None:
        if len(buf) - pos < RESPONSE_HEADER_SIZE + 1:
            return None
        h = decode_response_header(bytes(buf[pos : pos + RESPONSE_HEADER_SIZE]))
        return h.status <= max(Status) and 2 <= h.meta_len <= 1 << 20 and buf[pos + RESPONSE_HEADER_SIZE] == 0x7B


@dataclass
class _Exchange:
    op: int
    request: Message | None = None
    response: Message | None = None
    responded: bool = False  # a response header was assigned to it
    dialect: Dialect | None = None  # of a PREFILL or DECODE request


class HydraStream(StreamDissector):
    """Both directions of one Hydra connection. ``emit(message)`` gets every finished message."""

    proto = "hydra"

    def __init__(self, stream: int, emit: Callable[[Message], None], *, keep: int, hex_keep: int,
                 client: str = "", server: str = "", pairing: bool = True):
        self.stream, self._emit, self.keep, self.hex_keep = stream, emit, keep, hex_keep
        self.pairing = pairing  # False for --hex/--raw input: a lone response is expected there
        self.client, self.server = client, server
        self.exchanges: deque[_Exchange] = deque()
        self.req = RequestReader(self._request_done, keep, self._request_header)
        self.resp = ResponseReader(self._response_done, keep, self._response_header)

    # ---- pairing -------------------------------------------------------------------------
    def _request_header(self, pdu: Pdu) -> None:
        ex = _Exchange(pdu.info["op"])
        pdu.info["exchange"] = ex
        self.exchanges.append(ex)

    def _response_header(self, pdu: Pdu) -> bool:
        """Assign the response to the oldest unanswered request; True = PIN stream follows."""
        ex = next((e for e in self.exchanges if not e.responded), None)
        pdu.info["exchange"] = ex
        if ex is None:
            return False
        ex.responded = True
        return pin_stream_follows(ex.dialect, pdu.info["header"])

    def _link(self, ex: _Exchange) -> None:
        if ex.request is not None and ex.response is not None:
            ex.request.peer, ex.response.peer = ex.response, ex.request
        while self.exchanges and self.exchanges[0].response is not None and self.exchanges[0].request is not None:
            self.exchanges.popleft()

    # ---- messages ------------------------------------------------------------------------
    def _request_done(self, pdu: Pdu) -> None:
        msg = self._base(pdu, "request")
        if pdu.junk:
            self._junk(msg, pdu, "request")
            lost = pdu.info.get("exchange")
            if lost is not None and not lost.responded and lost in self.exchanges:
                self.exchanges.remove(lost)  # its request never completed: do not pair with it
            self._emit(msg)
            return
        self._dissect_guarded(msg, self._dissect_request, pdu)
        ex: _Exchange | None = pdu.info.get("exchange")
        if ex is not None:
            ex.request = msg
            self._link(ex)
        self._emit(msg)

    def _response_done(self, pdu: Pdu) -> None:
        msg = self._base(pdu, "response")
        if pdu.junk:
            self._junk(msg, pdu, "response")
            self._emit(msg)
            return
        ex: _Exchange | None = pdu.info.get("exchange")
        self._dissect_guarded(msg, self._dissect_response, pdu, ex)
        if ex is not None:
            ex.response = msg
            self._link(ex)
        self._emit(msg)

    def _dissect_request(self, msg: Message, pdu: Pdu) -> None:
        kept = bytes(pdu.kept)
        msg.fields = construct_fields(REQUEST_HEADER, None, 0, "hydra", show_value, values=pdu.info["header"])
        i = pdu.info
        op, kl, tl, pl = i["op"], i["key_len"], i["trace_len"], i["payload_len"]
        hs = REQUEST_HEADER_SIZE
        key, trace = kept[hs : hs + kl], kept[hs + kl : hs + kl + tl]
        msg.attrs.update(op=Named(op, op_name(op)), key=text(key), trace=text(trace), payload_len=pl,
                         key_len=kl, trace_len=tl)
        if kl:
            msg.add("hydra.key", text(key), hs, kl)
        if tl:
            msg.add("hydra.trace", text(trace), hs + kl, tl)
        if op not in KNOWN_OPS:
            msg.note(f"unknown opcode 0x{op:02x}", WARN)
        elif op == Op.SLOT_ERASE or 0x20 <= op <= 0x27:
            msg.note(f"retired agent opcode 0x{op:02x}: every server answers ERROR", NOTE)
        base = hs + kl + tl
        detail = ""
        if pl:
            pf = msg.add("hydra.payload", None, base, pl, show=human(pl))
            before = len(msg.fields)
            detail, dialect = HP.request(HP.Payload(msg, kept[base : base + pl], base, pl), op)
            if isinstance(dialect, Dialect):
                pdu.info["exchange"].dialect = dialect
                dialect = dialect.label
            if dialect:
                msg.attrs["dialect"] = dialect
            # Payload fields were appended at top level; nest them under hydra.payload.
            pf.children, msg.fields[before:] = msg.fields[before:], []
        self._truncation_note(msg, pdu, pl, base)
        msg.summary = f"{op_name(op)} key={text(key)!r}" + (f" trace={text(trace)!r}" if tl else "") + (
            f" {detail}" if detail else "")

    def _dissect_response(self, msg: Message, pdu: Pdu, ex: _Exchange | None) -> None:
        kept = bytes(pdu.kept)
        msg.fields = construct_fields(RESPONSE_HEADER, None, 0, "hydra", show_value, values=pdu.info["header"])
        i = pdu.info
        status, ml, pl = i["status"], i["meta_len"], i["payload_len"]
        op = ex.op if ex is not None else None
        dialect = ex.dialect if ex is not None else None
        msg.attrs.update(status=Named(status, status_name(status)), meta_len=ml, payload_len=pl)
        if ex is None and self.pairing:
            msg.note("response with no request waiting for one (capture started mid-stream?)", WARN)
        meta: Any = None
        hs = RESPONSE_HEADER_SIZE
        meta_raw = kept[hs : hs + ml]
        if ml:
            if len(meta_raw) == ml:
                mf = HP.json_field(HP.Payload(msg, meta_raw, hs, ml), msg, "hydra.meta", meta_raw, hs)
                meta = mf.value
                if not isinstance(meta, dict):
                    msg.note("meta is not a JSON object", WARN)
            else:
                msg.add("hydra.meta", text(meta_raw), hs, ml, show="(meta not fully captured)")
        base = hs + ml
        detail = ""
        if i.get("pin_stream"):
            detail = HP.pin_pieces(msg, kept[base:], base, pdu.seen - base)
        elif pl:
            pf = msg.add("hydra.payload", None, base, pl, show=human(pl))
            before = len(msg.fields)
            detail = HP.response(HP.Payload(msg, kept[base : base + pl], base, pl), op, status, meta, dialect,
                                 pdu.digest())
            pf.children, msg.fields[before:] = msg.fields[before:], []
        self._truncation_note(msg, pdu, pl, base)
        if isinstance(meta, dict) and isinstance(meta.get("error"), str) and status != Status.OK:
            msg.attrs["error"] = meta["error"]
        m = (" " + compact(meta, 120)) if ml and meta is not None else ""
        msg.summary = f"{status_name(status)}" + (f" {op_name(op)}" if op is not None else "") + m + (
            f" {detail}" if detail else "")

    def _junk(self, msg: Message, pdu: Pdu, direction: str) -> None:
        reason = pdu.info.get("reason") or "bytes do not parse as a Hydra " + direction
        self._show_raw(msg, pdu, f"{reason}; {human(pdu.seen)} shown raw" + (
            f", next {direction} header found at stream offset {pdu.info['resync_at']}" if "resync_at" in pdu.info
            else ""),
            f"undecodable {human(pdu.seen)}: {bytes(pdu.kept[:12]).hex(' ')}")

    def _truncation_note(self, msg: Message, pdu: Pdu, payload_len: int, base: int) -> None:
        if pdu.ended_early:
            got = max(0, pdu.seen - base)
            msg.note(f"payload_len claims {human(payload_len)}, stream ended after {human(got)}"
                     if pdu.seen >= base else
                     f"header announces {human(pdu.declared)} in all, stream ended after {human(pdu.seen)}", ERROR)
        if pdu.missing:
            msg.note(f"{human(pdu.missing_bytes)} of this message missing from the capture "
                     f"(at {', '.join(str(o) for o, _ in pdu.missing[:5])})", WARN)
        if pdu.seen > len(pdu.kept) and pdu.kept_contiguous and not pdu.ended_early:
            msg.note(f"only the first {human(len(pdu.kept))} kept for decoding (--max-keep)", NOTE)

"""TCP stream reassembly (sans-IO): segments in capture order → each direction's bytes in order.

What it copes with, because real loopback captures have all of it:

* out-of-order segments (held until the hole before them fills);
* retransmissions and overlaps (bytes already delivered are dropped, partial overlaps trimmed;
  the first copy of a byte wins, as in Wireshark's default);
* several PDUs per segment and one PDU over many segments (that is the dissectors' job: this
  layer only delivers bytes);
* 32-bit sequence wrap-around (offsets are 64-bit, unwrapped near the expected position);
* captures that start mid-connection (no SYN: the first segment seen starts the stream);
* bytes the capture never saw (a hole that never fills, a packet cut by the snap length):
  reported as a gap of known size, so a dissector can keep its framing when the gap falls
  inside a body whose length it knows;
* port reuse (a new SYN after a FIN/RST starts a new stream).

A stream's *client* is the side that sent the SYN; without one, the side talking to a
``server_ports`` port; without that, the side with the ephemeral (higher, ≥ 32768) port;
without that, the first sender.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable

FIN, SYN, RST, ACK = 0x01, 0x02, 0x04, 0x10
MAX_PENDING = 64 * 1024 * 1024  # out-of-order bytes held per direction before declaring a hole
Endpoint = tuple[str, int]


@dataclass(frozen=True)
class Segment:
    ts: float
    frame: int | None
    src: Endpoint
    dst: Endpoint
    seq: int
    flags: int
    payload: bytes
    missing_tail: int = 0  # payload bytes cut off by the capture's snap length


@dataclass(frozen=True)
class StreamOpen:
    stream: int
    client: Endpoint
    server: Endpoint
    ts: float
    syn_seen: bool


@dataclass(frozen=True)
class StreamData:
    stream: int
    direction: str  # "c2s" / "s2c"
    offset: int
    data: bytes
    ts: float
    frame: int | None


@dataclass(frozen=True)
class StreamGap:
    stream: int
    direction: str
    offset: int
    length: int
    ts: float | None
    frame: int | None


@dataclass(frozen=True)
class StreamEnd:
    stream: int
    direction: str
    ts: float | None
    frame: int | None
    reason: str  # "fin", "rst", "capture ended"


Event = StreamOpen | StreamData | StreamGap | StreamEnd


@dataclass
class _Half:
    """One direction of one stream."""

    direction: str
    base: int | None = None  # absolute sequence number of stream offset 0
    delivered: int = 0  # next stream offset expected
    pending: dict[int, tuple[bytes | None, int, float, int | None]] = field(default_factory=dict)
    heap: list[int] = field(default_factory=list)
    pending_bytes: int = 0
    fin_at: int | None = None
    ended: bool = False
    retransmitted: int = 0  # bytes seen twice

    def rel(self, seq: int) -> int:
        assert self.base is not None
        r = (seq - self.base) & 0xFFFFFFFF
        cand = r + (self.delivered & ~0xFFFFFFFF)
        if cand - self.delivered > 1 << 31:
            cand -= 1 << 32
        elif self.delivered - cand > 1 << 31:
            cand += 1 << 32
        return cand


@dataclass
class _Stream:
    id: int
    client: Endpoint
    server: Endpoint
    c2s: _Half = field(default_factory=lambda: _Half("c2s"))
    s2c: _Half = field(default_factory=lambda: _Half("s2c"))
    client_isn: int | None = None
    closed: bool = False  # FIN or RST seen: a new SYN on this 4-tuple starts a new stream
    had_data: bool = False


class Reassembler:
    def __init__(self, server_ports: Iterable[int] = ()):
        self.server_ports = set(server_ports)
        self._streams: dict[frozenset, _Stream] = {}
        self._next_id = 0
        self.all_streams: list[_Stream] = []

    # ---- public --------------------------------------------------------------------------
    def add(self, seg: Segment) -> list[Event]:
        events: list[Event] = []
        key = frozenset((seg.src, seg.dst))
        st = self._streams.get(key)
        syn_only = seg.flags & SYN and not seg.flags & ACK
        if st is not None and syn_only and (st.closed or st.had_data) and seg.src == st.client \
                and st.client_isn != seg.seq:
            self._end_stream(st, events, "new connection on the same ports")
            st = None
        if st is None:
            st = self._new_stream(seg, events)
        half = st.c2s if seg.src == st.client else st.s2c
        if seg.flags & SYN:
            if half.base is None or (half.delivered == 0 and not half.pending):
                half.base = (seg.seq + 1) & 0xFFFFFFFF
            if seg.src == st.client:
                st.client_isn = seg.seq
            data_seq = seg.seq + 1
        else:
            if half.base is None:
                half.base = seg.seq  # capture started mid-connection
            data_seq = seg.seq
        if seg.payload or seg.missing_tail:
            st.had_data = True
            off = half.rel(data_seq & 0xFFFFFFFF)
            self._accept(st, half, off, seg.payload, seg, events)
            if seg.missing_tail:
                self._accept(st, half, off + len(seg.payload), None, seg, events, length=seg.missing_tail)
        if seg.flags & FIN:
            st.closed = True
            end = half.rel((data_seq + len(seg.payload) + seg.missing_tail) & 0xFFFFFFFF)
            if half.fin_at is None:
                half.fin_at = end
            self._maybe_end(st, half, events, seg.ts, seg.frame)
        if seg.flags & RST:
            st.closed = True
            for h in (st.c2s, st.s2c):
                self._flush(st, h, events, seg.ts, seg.frame)
                self._end(st, h, events, seg.ts, seg.frame, "rst")
        return events

    def finish(self) -> list[Event]:
        """End of input: deliver held segments across their holes, end every open direction."""
        events: list[Event] = []
        for st in self.all_streams:
            self._end_stream(st, events, "capture ended")
        return events

    # ---- internals -----------------------------------------------------------------------
    def _new_stream(self, seg: Segment, events: list[Event]) -> _Stream:
        client, server = self._roles(seg)
        st = _Stream(self._next_id, client, server)
        self._next_id += 1
        self._streams[frozenset((seg.src, seg.dst))] = st
        self.all_streams.append(st)
        events.append(StreamOpen(st.id, client, server, seg.ts, bool(seg.flags & SYN)))
        return st

    def _roles(self, seg: Segment) -> tuple[Endpoint, Endpoint]:
        if seg.flags & SYN:
            return (seg.src, seg.dst) if not seg.flags & ACK else (seg.dst, seg.src)
        if seg.dst[1] in self.server_ports:
            return seg.src, seg.dst
        if seg.src[1] in self.server_ports:
            return seg.dst, seg.src
        if seg.src[1] >= 32768 > seg.dst[1]:
            return seg.src, seg.dst
        if seg.dst[1] >= 32768 > seg.src[1]:
            return seg.dst, seg.src
        return seg.src, seg.dst

    def _accept(self, st: _Stream, half: _Half, off: int, data: bytes | None, seg: Segment,
                events: list[Event], length: int | None = None) -> None:
        if half.ended:
            return
        n = len(data) if data is not None else (length or 0)
        if n == 0:
            return
        end = off + n
        if end <= half.delivered:
            half.retransmitted += n
            return
        if off < half.delivered:
            cut = half.delivered - off
            half.retransmitted += cut
            data = data[cut:] if data is not None else None
            n -= cut
            off = half.delivered
        if off == half.delivered:
            self._deliver(st, half, off, data, n, seg.ts, seg.frame, events)
            self._drain(st, half, events)
        else:
            old = half.pending.get(off)
            if old is None:
                heapq.heappush(half.heap, off)
            if old is None or _plen(old) < n:
                half.pending_bytes += n - (_plen(old) if old else 0)
                half.pending[off] = (data, n, seg.ts, seg.frame)
            if half.pending_bytes > MAX_PENDING:
                # The hole is not going to fill (the capture lost it): report it and move on.
                first = half.heap[0]
                self._gap(st, half, first - half.delivered, seg.ts, seg.frame, events)
                self._drain(st, half, events)
        self._maybe_end(st, half, events, seg.ts, seg.frame)

    def _deliver(self, st: _Stream, half: _Half, off: int, data: bytes | None, n: int, ts: float,
                 frame: int | None, events: list[Event]) -> None:
        if data is None:
            events.append(StreamGap(st.id, half.direction, off, n, ts, frame))
        else:
            events.append(StreamData(st.id, half.direction, off, data, ts, frame))
        half.delivered = off + n

    def _gap(self, st: _Stream, half: _Half, n: int, ts: float | None, frame: int | None,
             events: list[Event]) -> None:
        if n > 0:
            events.append(StreamGap(st.id, half.direction, half.delivered, n, ts, frame))
            half.delivered += n

    def _drain(self, st: _Stream, half: _Half, events: list[Event]) -> None:
        while half.heap and half.heap[0] <= half.delivered:
            off = heapq.heappop(half.heap)
            data, n, ts, frame = half.pending.pop(off)
            half.pending_bytes -= n
            end = off + n
            if end <= half.delivered:
                half.retransmitted += n
                continue
            cut = half.delivered - off
            if cut:
                half.retransmitted += cut
                data = data[cut:] if data is not None else None
            self._deliver(st, half, half.delivered, data, n - cut, ts, frame, events)

    def _flush(self, st: _Stream, half: _Half, events: list[Event], ts: float | None,
               frame: int | None) -> None:
        """Deliver everything held, with gaps for the holes between."""
        while half.heap:
            first = half.heap[0]
            if first > half.delivered:
                self._gap(st, half, first - half.delivered, ts, frame, events)
            self._drain(st, half, events)
        if half.fin_at is not None and half.fin_at > half.delivered:
            self._gap(st, half, half.fin_at - half.delivered, ts, frame, events)

    def _maybe_end(self, st: _Stream, half: _Half, events: list[Event], ts: float | None,
                   frame: int | None) -> None:
        if half.fin_at is not None and half.delivered >= half.fin_at and not half.ended:
            self._end(st, half, events, ts, frame, "fin")

    def _end(self, st: _Stream, half: _Half, events: list[Event], ts: float | None, frame: int | None,
             reason: str) -> None:
        if not half.ended:
            half.ended = True
            events.append(StreamEnd(st.id, half.direction, ts, frame, reason))

    def _end_stream(self, st: _Stream, events: list[Event], reason: str) -> None:
        for h in (st.c2s, st.s2c):
            if not h.ended:
                self._flush(st, h, events, None, None)
                self._end(st, h, events, None, None, reason)
        key = frozenset((st.client, st.server))
        if self._streams.get(key) is st:
            del self._streams[key]


def _plen(entry: tuple[bytes | None, int, float, int | None]) -> int:
    return entry[1]

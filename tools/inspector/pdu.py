"""Cutting one direction of a TCP stream into PDUs (``tcp_dissect_pdus`` for this project).

A :class:`DirectionReader` receives the bytes of one direction in order (plus gaps where the
capture lost bytes, plus the end of the stream) and cuts them into :class:`Pdu` objects. A
protocol subclass says how long the fixed header is and, once it has it, how long the whole
PDU is (:meth:`DirectionReader.on_header`). Bodies are never held whole: the first ``keep``
bytes of each PDU are kept for dissection and the rest is only counted (and hashed, where a
protocol asks for it), so a 4 GiB STATE_PUT costs ``keep`` bytes of memory.

When a header is not plausible (bad magic, garbage after a desync), the subclass can ask to
*resynchronise*: bytes are set aside as one "undecodable" PDU until :meth:`plausible_at`
accepts a position, and cutting restarts there — Wireshark stops at the first bad PDU of a
stream; an operator chasing a desync wants to see what came after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import xxhash

UNTIL_EOF = -1  # a declared length meaning "everything until the stream ends" (PIN pieces)
JUNK_KEEP = 4096  # bytes of an undecodable run kept for display
JUNK_SCAN_LIMIT = 64 * 1024 * 1024  # give up looking for a header after this many bytes


@dataclass
class Pdu:
    start: int  # offset of the first byte in the direction's stream
    keep: int
    ts_first: float | None = None
    ts_last: float | None = None
    frame_first: int | None = None
    frame_last: int | None = None
    declared: int | None = None  # total length once the header told it; UNTIL_EOF for EOF-framed
    seen: int = 0  # bytes received (or known missing) so far
    kept: bytearray = field(default_factory=bytearray)
    kept_contiguous: bool = True  # False once a gap fell inside the kept prefix
    missing: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) lost by the capture
    junk: bool = False  # bytes that did not parse as this protocol
    ended_early: bool = False  # the stream ended before ``declared``
    info: dict = field(default_factory=dict)  # what the header parser learnt (for the dissector)
    hash_from: int | None = None  # hash bytes at offsets >= this (the payload)
    _hasher: object | None = None
    hash_broken: bool = False

    @property
    def remaining(self) -> int | None:
        if self.declared is None or self.declared == UNTIL_EOF:
            return None
        return self.declared - self.seen

    def stamp(self, ts: float | None, frame: int | None) -> None:
        if self.ts_first is None:
            self.ts_first, self.frame_first = ts, frame
        self.ts_last, self.frame_last = ts, frame

    def append(self, data: memoryview) -> None:
        n = len(data)
        if n == 0:
            return
        if self.kept_contiguous and len(self.kept) < self.keep:
            self.kept += data[: self.keep - len(self.kept)]
        if self.hash_from is not None and not self.hash_broken:
            lo = max(0, self.hash_from - self.seen)
            if lo < n:
                if self._hasher is None:
                    self._hasher = xxhash.xxh3_64()
                self._hasher.update(data[lo:])
        self.seen += n

    def append_gap(self, n: int) -> None:
        self.missing.append((self.seen, n))
        if len(self.kept) < self.keep and len(self.kept) == self.seen:
            self.kept_contiguous = False
        if self.hash_from is not None and self.seen + n > self.hash_from:
            self.hash_broken = True
        self.seen += n

    def start_hash(self, offset: int) -> None:
        """Hash every byte from ``offset`` (relative to the PDU) on; call from ``on_header``."""
        self.hash_from = offset
        if self.seen > offset:  # not expected: headers are parsed before the payload arrives
            self.hash_broken = True

    def digest(self) -> int | None:
        """XXH3-64 of the hashed region, None if bytes were missing or nothing was hashed."""
        if self.hash_from is None or self.hash_broken:
            return None
        if self._hasher is None:
            return xxhash.xxh3_64_intdigest(b"")
        return self._hasher.intdigest()

    @property
    def missing_bytes(self) -> int:
        return sum(n for _, n in self.missing)


class DirectionReader:
    """Cut one direction into PDUs. Subclasses set ``header_size`` and implement ``on_header``.

    ``emit(pdu)`` receives every finished PDU: complete ones, undecodable runs (``junk``) and,
    at the end of the stream, the one in progress (``ended_early``).
    """

    header_size = 1
    resyncs = False  # True: after a bad header, look for the next plausible one

    def __init__(self, emit: Callable[[Pdu], None], keep: int):
        self.emit = emit
        self.keep = keep
        self.offset = 0  # stream offset of the next byte to be cut (scan bytes are not cut yet)
        self.cur: Pdu | None = None
        self.broken: str | None = None  # set when resync gave up: the rest is one raw run
        self._scan = bytearray()  # junk mode: received bytes not yet ruled out as a header start
        self.ended = False

    # ---- hooks -------------------------------------------------------------------------
    def on_header(self, pdu: Pdu, header: bytes) -> bool:
        """Set ``pdu.declared`` (and ``pdu.info``). Return False if the header is not plausible."""
        raise NotImplementedError

    def plausible_at(self, buf: bytearray, pos: int) -> bool | None:
        """Resync: could a PDU start at ``buf[pos]``? None = need more bytes. Default: never."""
        return False

    def next_candidate(self, buf: bytearray, pos: int) -> int:
        """Resync: the first position ``>= pos`` worth asking :meth:`plausible_at` about."""
        return pos

    # ---- input -------------------------------------------------------------------------
    def feed(self, data: bytes, ts: float | None = None, frame: int | None = None) -> None:
        mv = memoryview(data)
        pos = 0
        while pos < len(mv):
            if self.cur is None:
                self.cur = Pdu(self.offset, self.keep)
            cur = self.cur
            cur.stamp(ts, frame)
            if cur.junk:
                self._scan += mv[pos:]
                rest = self._scan_junk()
                if rest is None:
                    return
                mv, pos = memoryview(rest), 0  # a header was found: cut from it on
                continue
            if cur.declared is None:
                take = min(self.header_size - cur.seen, len(mv) - pos)
            elif cur.declared == UNTIL_EOF:
                take = len(mv) - pos
            else:
                take = min(cur.declared - cur.seen, len(mv) - pos)
            cur.append(mv[pos : pos + take])
            pos += take
            self.offset += take
            if cur.declared is None:
                if cur.seen < self.header_size:
                    return
                if cur.missing or len(cur.kept) < self.header_size:
                    self._lose_sync(cur, "header bytes missing from the capture")
                    continue
                if not self.on_header(cur, bytes(cur.kept[: self.header_size])):
                    self._lose_sync(cur, None)
                    continue
            if cur.remaining == 0:
                self._finish(cur)

    def gap(self, length: int, ts: float | None = None, frame: int | None = None) -> None:
        """``length`` bytes of this direction are missing from the capture."""
        if length <= 0:
            return
        cur = self.cur
        if cur is not None and not cur.junk and cur.declared is not None:
            remaining = cur.remaining
            if remaining is None or remaining >= length:
                # Inside a body whose length we know (or that runs to EOF): framing survives.
                cur.stamp(ts, frame)
                cur.append_gap(length)
                self.offset += length
                if cur.remaining == 0:
                    self._finish(cur)
                return
        if cur is None:
            cur = self.cur = Pdu(self.offset, self.keep)
        cur.stamp(ts, frame)
        if not cur.junk:
            self._lose_sync(cur, f"{length} bytes missing from the capture at stream offset {self.offset}")
        junk = self.cur
        assert junk is not None and junk.junk
        # Whatever was waiting to be scanned cannot be joined to what follows the gap.
        if self._scan:
            junk.append(memoryview(self._scan))
            self.offset += len(self._scan)
            self._scan.clear()
        junk.append_gap(length)
        self.offset += length

    def end(self, ts: float | None = None, frame: int | None = None) -> None:
        """The direction ended (FIN, RST, end of capture): flush what is in progress."""
        if self.ended:
            return
        self.ended = True
        cur, self.cur = self.cur, None
        if cur is None:
            return
        if self._scan:
            cur.append(memoryview(self._scan))
            self.offset += len(self._scan)
            self._scan.clear()
        if cur.seen == 0:
            return
        if not cur.junk and cur.declared is None:
            # Not even a whole header: nothing to dissect, show the bytes.
            cur.junk = True
            cur.info["reason"] = f"stream ended inside a header ({cur.seen} of {self.header_size} bytes)"
        elif not cur.junk and cur.declared != UNTIL_EOF:
            cur.ended_early = True
        self.emit(cur)

    # ---- internals ---------------------------------------------------------------------
    def _finish(self, cur: Pdu) -> None:
        self.cur = None
        self.emit(cur)

    def _lose_sync(self, cur: Pdu, reason: str | None) -> None:
        """Turn the PDU in progress into an undecodable run and look for the next header.

        Its bytes after the first are scanned again: the next header may start inside them.
        """
        junk = Pdu(cur.start, min(self.keep, JUNK_KEEP), junk=True, info=dict(cur.info))
        junk.stamp(cur.ts_first, cur.frame_first)
        junk.stamp(cur.ts_last, cur.frame_last)
        if reason:
            junk.info["reason"] = reason
        self.cur = junk
        if not cur.missing and len(cur.kept) == cur.seen:
            data = bytes(cur.kept)
            self.offset = cur.start + 1
            junk.append(memoryview(data)[:1])
            self._scan = bytearray(data[1:])
        else:  # bytes are missing: nothing to rescan, the junk run takes the PDU as it is
            junk.seen, junk.kept, junk.missing = cur.seen, cur.kept, cur.missing
            junk.kept_contiguous = cur.kept_contiguous
            self._scan = bytearray()

    def _scan_junk(self) -> bytes | None:
        """Rule out header starts in ``_scan``. Returns the bytes from a found header on (the
        junk PDU is emitted first), or None when more input is needed."""
        cur = self.cur
        assert cur is not None and cur.junk
        buf = self._scan
        found = False
        pos = 0
        if self.broken is None and not self.resyncs:
            self.broken = "this protocol cannot be resynchronised; the rest of the direction is shown raw"
        if self.broken is None:
            while pos < len(buf):
                pos = min(self.next_candidate(buf, pos), len(buf))
                if pos >= len(buf):
                    break
                verdict = self.plausible_at(buf, pos)
                if verdict is None:
                    break
                if verdict:
                    found = True
                    break
                pos += 1
        else:
            pos = len(buf)
        if pos:
            cur.append(memoryview(buf)[:pos])
            self.offset += pos
            del buf[:pos]
        if not found:
            if cur.seen > JUNK_SCAN_LIMIT and self.broken is None:
                self.broken = f"no plausible header in {JUNK_SCAN_LIMIT >> 20} MiB; the rest is shown raw"
                cur.append(memoryview(buf))
                self.offset += len(buf)
                buf.clear()
            return None
        rest = bytes(buf)
        buf.clear()
        cur.info["resync_at"] = self.offset
        self._finish(cur)
        return rest

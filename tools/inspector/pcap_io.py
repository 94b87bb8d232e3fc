"""Capture files in and out, through dpkt (no hand-parsed capture formats).

Reading: pcap (µs or ns) and pcapng, optionally gzip-compressed, from a path or ``-``
(stdin); link types Ethernet, Linux cooked (SLL, SLL2), BSD loopback and raw IP; IPv4 and
IPv6; TCP only. Each TCP packet becomes a :class:`~tools.inspector.reassembly.Segment`;
anything that does not decode is counted in :class:`ReadStats`, never raised.

Writing (the tap's ``--write``): Ethernet/IPv4/TCP packets with a proper handshake, sequence
numbers and FIN, so a tap recording reads back through the same path as a tcpdump capture —
and opens in Wireshark.
"""
from __future__ import annotations

import gzip
import io
import ipaddress
import socket
import struct
import sys
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator

import dpkt

from .reassembly import ACK, FIN, SYN, Segment

PCAP_MAGICS = {b"\xd4\xc3\xb2\xa1", b"\xa1\xb2\xc3\xd4", b"\x4d\x3c\xb2\xa1", b"\xa1\xb2\x3c\x4d"}
PCAPNG_MAGIC = b"\x0a\x0d\x0d\x0a"
GZIP_MAGIC = b"\x1f\x8b"
LINKTYPE_RAW = (101, 12, 14)
LINKTYPE_IPV4, LINKTYPE_IPV6 = 228, 229


class CaptureError(Exception):
    """The input is not a capture file we can read (the message says why)."""


@dataclass
class ReadStats:
    packets: int = 0
    tcp: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason → count
    truncated_file: bool = False

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


class _Prefixed(io.RawIOBase):
    """A forward-only reader that first returns bytes already peeked (stdin cannot seek)."""

    def __init__(self, head: bytes, rest: BinaryIO):
        self._head, self._rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        # read1: what the pipe holds now (at least a byte), not len(b) bytes — a plain read
        # waits for a whole buffer, so packets from `tcpdump -U -w -` would show up only in
        # 8 KiB batches, or at tcpdump's exit
        read1 = getattr(self._rest, "read1", self._rest.read)
        data = read1(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._rest.close()
        super().close()


def peek(f: BinaryIO, n: int) -> tuple[bytes, BinaryIO]:
    """``(the first n bytes, a stream that still starts with them)``: ``f`` may be a pipe."""
    head = b""
    read1 = getattr(f, "read1", f.read)
    while len(head) < n:  # a pipe may deliver fewer bytes per read
        more = read1(n - len(head))
        if not more:
            break
        head += more
    return head, io.BufferedReader(_Prefixed(head, f))  # type: ignore[return-value]


def open_capture(path: str) -> tuple[BinaryIO, bytes]:
    """``(binary stream, its first 4 bytes)`` for ``path`` (``-`` = stdin), gunzipped if gzip.

    Everything is read forward only, so a capture can be piped in (``tcpdump -w - | …``).
    """
    raw: BinaryIO = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    head, f = peek(raw, 2)
    if head == GZIP_MAGIC:
        f = gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[assignment]
    magic, f = peek(f, 4)
    return f, magic


def _reader(f: BinaryIO, magic: bytes):
    if magic == PCAPNG_MAGIC:
        return dpkt.pcapng.Reader(f)
    if magic in PCAP_MAGICS:
        return dpkt.pcap.Reader(f)
    raise CaptureError(f"not a pcap or pcapng file (starts with {magic.hex(' ') or 'nothing'})")


def read_segments(f: BinaryIO, stats: ReadStats, magic: bytes | None = None) -> Iterator[Segment]:
    """TCP segments of a capture, in file order, numbered like Wireshark frames (from 1).

    ``magic``: the first 4 bytes when the caller already peeked them (``open_capture``);
    otherwise ``f`` must be seekable.
    """
    try:
        if magic is None:
            magic = f.read(4)
            f.seek(0)
        reader = _reader(f, magic)
        linktype = reader.datalink()
    except CaptureError:
        raise
    except (ValueError, struct.error, dpkt.Error, EOFError, OSError) as e:
        raise CaptureError(f"cannot read the capture header: {e}") from None
    it = iter(reader)
    frame = 0
    while True:
        try:
            ts, buf = next(it)
        except StopIteration:
            return
        except (ValueError, struct.error, dpkt.Error, EOFError, OSError):
            stats.truncated_file = True  # a cut-off file: keep what we read
            return
        frame += 1
        stats.packets += 1
        try:
            seg = _segment(float(ts), frame, linktype, bytes(buf), stats)
        except (dpkt.Error, ValueError, struct.error, IndexError, TypeError):
            stats.skip("undecodable packet")
            continue
        if seg is not None:
            stats.tcp += 1
            yield seg


def _network_layer(linktype: int, buf: bytes) -> object | None:
    if linktype == dpkt.pcap.DLT_EN10MB:
        return dpkt.ethernet.Ethernet(buf).data
    if linktype == dpkt.pcap.DLT_LINUX_SLL:
        return dpkt.sll.SLL(buf).data
    if linktype == dpkt.pcap.DLT_LINUX_SLL2:
        return dpkt.sll2.SLL2(buf).data
    if linktype in (dpkt.pcap.DLT_NULL, dpkt.pcap.DLT_LOOP):
        return dpkt.loopback.Loopback(buf).data
    if linktype in LINKTYPE_RAW or linktype in (LINKTYPE_IPV4, LINKTYPE_IPV6):
        if not buf:
            return None
        return dpkt.ip.IP(buf) if buf[0] >> 4 == 4 else dpkt.ip6.IP6(buf)
    return None


def _segment(ts: float, frame: int, linktype: int, buf: bytes, stats: ReadStats) -> Segment | None:
    net = _network_layer(linktype, buf)
    if isinstance(net, dpkt.ip.IP):
        if net.p != dpkt.ip.IP_PROTO_TCP or net.offset != 0:
            stats.skip("not TCP" if net.p != dpkt.ip.IP_PROTO_TCP else "IP fragment")
            return None
        src, dst = socket.inet_ntop(socket.AF_INET, net.src), socket.inet_ntop(socket.AF_INET, net.dst)
        ip_payload_len = net.len - (net.hl << 2) if net.len else None
    elif isinstance(net, dpkt.ip6.IP6):
        if net.nxt != dpkt.ip.IP_PROTO_TCP:
            stats.skip("not TCP")
            return None
        src, dst = socket.inet_ntop(socket.AF_INET6, net.src), socket.inet_ntop(socket.AF_INET6, net.dst)
        ip_payload_len = net.plen or None
    else:
        stats.skip(f"link type {linktype}: not IP" if net is None else "not IP")
        return None
    tcp = net.data
    if not isinstance(tcp, dpkt.tcp.TCP):
        stats.skip("truncated TCP header")
        return None
    payload = bytes(tcp.data)
    missing = 0
    if ip_payload_len is not None:
        # A packet cut by the snap length: the IP header still says how much was sent.
        missing = max(0, ip_payload_len - (tcp.off << 2) - len(payload))
    return Segment(ts, frame, (src, tcp.sport), (dst, tcp.dport), tcp.seq, tcp.flags, payload, missing)


# ---- writing -------------------------------------------------------------------------------

MAX_SEGMENT = 32768  # bytes of TCP payload per written packet (IPv4 total length is 16 bits)


def _ip_bytes(host: str) -> bytes:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = ipaddress.ip_address("127.0.0.1")
    if addr.version != 4:  # the writer emits IPv4; map others to a stable loopback address
        addr = ipaddress.ip_address("127.0.0.2")
    return addr.packed


class PcapWriter:
    """Writes synthetic TCP conversations; flushes after every packet (a crash loses nothing)."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.w = dpkt.pcap.Writer(f, snaplen=65535, linktype=dpkt.pcap.DLT_EN10MB)
        self._conns: dict[int, dict] = {}

    def open(self, conn: int, client: tuple[str, int], server: tuple[str, int], ts: float) -> None:
        c = {"client": client, "server": server, "seq": {"c2s": 1000, "s2c": 5000}}
        self._conns[conn] = c
        self._packet(c, "c2s", SYN, b"", ts, seq=999)
        self._packet(c, "s2c", SYN | ACK, b"", ts, seq=4999)
        self._packet(c, "c2s", ACK, b"", ts)

    def data(self, conn: int, direction: str, data: bytes, ts: float) -> None:
        c = self._conns.get(conn)
        if c is None:
            return
        for i in range(0, len(data), MAX_SEGMENT):
            chunk = data[i : i + MAX_SEGMENT]
            self._packet(c, direction, ACK | 0x08, chunk, ts)
            c["seq"][direction] += len(chunk)

    def fin(self, conn: int, direction: str, ts: float) -> None:
        c = self._conns.get(conn)
        if c is None or c.get(f"fin_{direction}"):
            return
        c[f"fin_{direction}"] = True
        self._packet(c, direction, FIN | ACK, b"", ts)
        c["seq"][direction] += 1

    def _packet(self, c: dict, direction: str, flags: int, data: bytes, ts: float, seq: int | None = None) -> None:
        src, dst = (c["client"], c["server"]) if direction == "c2s" else (c["server"], c["client"])
        other = "s2c" if direction == "c2s" else "c2s"
        tcp = dpkt.tcp.TCP(sport=src[1], dport=dst[1], seq=c["seq"][direction] if seq is None else seq,
                           ack=c["seq"][other] if flags & ACK else 0, flags=flags, win=65535, data=data)
        ip = dpkt.ip.IP(src=_ip_bytes(src[0]), dst=_ip_bytes(dst[0]), p=dpkt.ip.IP_PROTO_TCP, ttl=64, data=tcp)
        ip.len = 20 + len(bytes(tcp))
        eth = dpkt.ethernet.Ethernet(src=b"\0" * 6, dst=b"\0" * 6, type=dpkt.ethernet.ETH_TYPE_IP, data=ip)
        self.w.writepkt(bytes(eth), ts=ts)
        self.f.flush()

    def close(self) -> None:
        self.f.flush()

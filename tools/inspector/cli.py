"""hydra-rpc inspect: see what crosses a Hydra engine port (Hydra and ggml-RPC).

Inputs (one of):
  FILE | -r FILE          pcap / pcapng, gzip'd or not; ``-`` reads stdin as it arrives
                          (tcpdump -U -w - … | hydra-rpc inspect -)
  -i IFACE                live capture through tcpdump (or dumpcap); --port N narrows it
  --listen H:P --upstream H:P [--write F.pcap]
                          live tap: a transparent proxy that decodes as it forwards
  --hex | --raw           one direction's bytes on stdin (hex text pasted from a log, or raw)
  --dissector             print a Wireshark Lua dissector for Hydra framing and exit

Output: one line per message (default), ``-V`` field tree with byte offsets, ``-x`` hex dump,
``--json`` NDJSON (every field with name, value, offset, length), ``-T fields -e F …``
tab-separated values (as tshark), ``--stats`` counts and latency percentiles. ``-Y`` filters
messages, e.g. ``-Y 'op == DECODE and status != OK'``; ``-Y help`` prints the filter
language. Times are seconds since the capture's first packet, filtered or not (as tshark's).

Exit status: 0 on success (also when the capture holds malformed traffic: that is shown, not
fatal), 1 when the input cannot be read at all, 2 on a usage or filter error.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import TextIO

from .filters import FilterError, check_field, compile_filter
from .model import Message
from .render import Renderer, ndjson
from hydra_rpc.config import hostport_arg

from .session import Options, Session
from .stats import Stats


def _version(s: str) -> tuple[int, int, int]:
    try:
        parts = tuple(int(x) for x in s.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MAJOR[.MINOR[.PATCH]], got {s!r}") from None
    if not 1 <= len(parts) <= 3 or not all(0 <= x <= 255 for x in parts):
        raise argparse.ArgumentTypeError(f"expected MAJOR[.MINOR[.PATCH]], got {s!r}")
    return (parts + (0, 0))[:3]  # type: ignore[return-value]


def _size(s: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1:].lower(), 1)
    try:
        return int(s[:-1] if mult > 1 else s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 64k, 16m; got {s!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.epilog = __doc__.split("\n\n", 1)[1]
    i = p.add_argument_group("input")
    i.add_argument("file", nargs="?", help="capture file (pcap/pcapng, may be gzip'd); '-' for stdin")
    i.add_argument("-r", dest="read_file", metavar="FILE", help="same as the positional FILE (tshark style)")
    i.add_argument("-i", dest="iface", metavar="IFACE",
                   help="capture live on IFACE (e.g. lo) through tcpdump or dumpcap; --port N narrows the capture")
    i.add_argument("--listen", type=hostport_arg, metavar="HOST:PORT", help="live tap: accept clients here …")
    i.add_argument("--upstream", type=hostport_arg, metavar="HOST:PORT", help="… and forward them to this server")
    i.add_argument("--write", metavar="FILE.pcap", help="live tap: also record the traffic as a pcap")
    i.add_argument("--hex", action="store_true", help="read one direction as hex text from stdin")
    i.add_argument("--raw", action="store_true", help="read one direction as raw bytes from stdin")
    i.add_argument("--direction", choices=["auto", "request", "response"], default="auto",
                   help="--hex/--raw: which direction the bytes are (auto: 59 48 or 0E = client requests)")
    i.add_argument("--dissector", action="store_true", help="print a Wireshark Lua dissector for Hydra and exit")
    d = p.add_argument_group("decoding")
    d.add_argument("--port", type=int, action="append", default=[], metavar="N",
                   help="a server port (repeatable): tells client from server when the capture lacks the SYN; "
                        "with --decode-as, forces that protocol on streams to this port")
    d.add_argument("--decode-as", choices=["hydra", "ggml"], help="protocol of streams not recognised from "
                                                                  "their first bytes (or of --port streams)")
    d.add_argument("--ggml-version", type=_version, metavar="X.Y.Z",
                   help="ggml-RPC command table for streams whose HELLO is not in the capture")
    d.add_argument("--ggml-fork", choices=["upstream", "ddvnguyen", "llama-box"], default=None,
                   help="ggml-RPC fork whose extra commands to name (default upstream)")
    d.add_argument("--max-keep", type=_size, default=64 << 20, metavar="BYTES",
                   help="bytes of each message kept for decoding (default 64m); the rest is counted and hashed")
    o = p.add_argument_group("output")
    o.add_argument("-V", dest="verbose", action="store_true", help="field tree with byte offsets")
    o.add_argument("-x", dest="hexdump", action="store_true", help="hex + ASCII dump of each message")
    o.add_argument("--hex-bytes", type=_size, default=4096, metavar="N", help="bytes per message in -x (default 4096)")
    o.add_argument("--json", action="store_true", help="NDJSON: one object per message, every field with offsets")
    o.add_argument("-T", dest="output_format", choices=["text", "fields", "json"], default="text",
                   help="output format as tshark's: fields (with -e) prints tab-separated values; json = --json")
    o.add_argument("-e", dest="fields", action="append", default=[], metavar="FIELD",
                   help="-T fields: a field to print (repeatable): any -Y field (op, status, key, latency, …), "
                        "a dotted protocol field (hydra.kv.n_past), or time (seconds since the first packet)")
    o.add_argument("--stats", action="store_true", help="per-op counts, statuses, latency p50/p95/p99, bytes")
    o.add_argument("-q", dest="quiet", action="store_true", help="no per-message output (with --stats)")
    o.add_argument("-Y", dest="filter", default="", metavar="FILTER", help="show only messages matching FILTER")
    o.add_argument("-c", dest="count", type=int, default=None, metavar="N", help="stop after N shown messages")
    o.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="colour the output; auto: on a terminal, never with --json")


class Output:
    """Filters, numbers and renders messages; keeps the statistics of what was shown."""

    def __init__(self, args: argparse.Namespace, out: TextIO, match, *, live: bool):
        self.args, self.out, self.match, self.live = args, out, match, live
        colour = args.color == "always" or (args.color == "auto" and not args.json and out.isatty())
        self.r = Renderer(colour=colour)
        self.stats = Stats()
        self.shown = 0
        self.numbered = 0
        self.quiet = args.quiet or (args.stats and not (args.verbose or args.hexdump or args.json or args.fields))

    def first_packet(self, ts: float) -> None:
        """Times are capture-relative (tshark's frame.time_relative): from the first packet, not
        from the first message a filter lets through."""
        if self.r.t0 is None:
            self.r.t0 = ts

    def number(self, m: Message) -> None:
        self.numbered += 1
        m.number = self.numbered

    def show(self, m: Message) -> None:
        if self.args.count is not None and self.shown >= self.args.count:
            return
        if not self.match(m.filter_values()):
            return
        self.shown += 1
        self.stats.add(m)
        if self.quiet:
            return
        a = self.args
        if a.json:
            self.out.write(ndjson(m) + "\n")
        elif a.output_format == "fields":
            self.out.write(self.fields_line(m) + "\n")
        else:
            parts = [self.r.tree(m) if a.verbose else self.r.summary(m)]
            if a.hexdump:
                parts.append(self.r.hexdump(m))
            self.out.write("\n".join(parts) + ("\n\n" if a.verbose or a.hexdump else "\n"))
        if self.live:
            self.out.flush()

    def fields_line(self, m: Message) -> str:
        values = m.filter_values()
        if m.ts_first is not None:
            self.first_packet(m.ts_first)
            values["time"] = f"{m.ts_first - self.r.t0:.6f}"
        return "\t".join(_field_text(values.get(name)) for name in self.args.fields)

    def finish(self) -> None:
        if self.args.stats:
            if self.args.json:
                self.out.write(json.dumps({"stats": self.stats.as_dict()}, separators=(",", ":")) + "\n")
            else:
                self.out.write(self.stats.render() + "\n")
        self.out.flush()


def _field_text(v) -> str:
    """A -T fields value: as tshark prints it (empty when absent; tabs and newlines escaped so a
    client's key cannot add a column or a line)."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return f"{v:.6f}"
    text = v.hex() if isinstance(v, bytes) else str(v)
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _check_output(args: argparse.Namespace) -> str | None:
    """The -T/-e combination's mistake, if any."""
    if args.output_format == "json":
        args.json = True
    if args.output_format == "fields" and not args.fields:
        return "-T fields needs at least one -e FIELD (e.g. -e op -e status -e latency)"
    if args.fields and args.output_format != "fields":
        return "-e FIELD prints only with -T fields"
    for name in args.fields:
        if name != "time":
            try:
                check_field(name)
            except FilterError as e:
                return f"-e: {e}"
    return None


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BrokenPipeError:  # `hydra-rpc inspect … | head`
        try:
            sys.stdout = open("/dev/null", "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return 0


def _run(args: argparse.Namespace) -> int:
    if args.dissector:
        from .lua_dissector import generate

        sys.stdout.write(generate())
        return 0
    if args.filter.strip() == "help":
        from .filters import HELP

        sys.stdout.write(HELP)
        return 0
    try:
        match = compile_filter(args.filter)
    except FilterError as e:
        print(f"hydra-rpc inspect: bad filter: {e}", file=sys.stderr)
        return 2
    mistake = _check_output(args)
    if mistake:
        print(f"hydra-rpc inspect: {mistake} (see `hydra-rpc inspect --help`)", file=sys.stderr)
        return 2
    opts = Options(keep=max(64 * 1024, args.max_keep), hex_keep=args.hex_bytes, server_ports=frozenset(args.port),
                   decode_as=args.decode_as, ggml_version=args.ggml_version,
                   ggml_fork=None if args.ggml_fork in (None, "upstream") else args.ggml_fork)
    path = args.file or args.read_file
    modes = [bool(path), bool(args.iface), bool(args.listen or args.upstream), bool(args.hex or args.raw)]
    if sum(modes) != 1:
        print("hydra-rpc inspect: give exactly one input: FILE, -i IFACE, --listen/--upstream, or --hex/--raw",
              file=sys.stderr)
        return 2
    if path == "-" or args.iface:
        return _run_live(args, opts, match)
    if args.listen or args.upstream:
        if not (args.listen and args.upstream):
            print("hydra-rpc inspect: the tap needs both --listen and --upstream", file=sys.stderr)
            return 2
        return _run_tap(args, opts, match)
    if args.hex or args.raw:
        return _run_bytes(args, opts, match)
    return _run_file(path, args, opts, match)


def _run_file(path: str, args: argparse.Namespace, opts: Options, match) -> int:
    from .pcap_io import CaptureError, ReadStats, open_capture, read_segments
    from .reassembly import Reassembler

    out = Output(args, sys.stdout, match, live=False)
    messages: list[Message] = []
    session = Session(opts, messages.append)
    reasm = Reassembler(opts.server_ports)
    rstats = ReadStats()
    try:
        f, magic = open_capture(path)
    except (OSError, EOFError) as e:
        print(f"hydra-rpc inspect: cannot open {path}: {e}", file=sys.stderr)
        return 1
    try:
        with f:
            for seg in read_segments(f, rstats, magic):
                out.first_packet(seg.ts)
                for ev in reasm.add(seg):
                    session.handle(ev)
    except CaptureError as e:
        print(f"hydra-rpc inspect: {path}: {e}", file=sys.stderr)
        return 1
    except (OSError, EOFError) as e:  # e.g. a gzip stream cut short
        print(f"hydra-rpc inspect: {path}: read stopped: {e}; showing what was read", file=sys.stderr)
        rstats.truncated_file = True
    for ev in reasm.finish():
        session.handle(ev)
    session.finish()
    # Capture order by first byte, like frame numbers: a request before its response.
    order = sorted(range(len(messages)), key=lambda i: (messages[i].ts_first is None,
                                                         messages[i].ts_first or 0.0, i))
    ordered = [messages[i] for i in order]
    for m in ordered:
        out.number(m)
    for m in ordered:
        out.show(m)
    out.finish()
    if rstats.truncated_file:
        print("hydra-rpc inspect: the capture file ends inside a packet record (cut short?)", file=sys.stderr)
    if rstats.packets == 0:
        print("hydra-rpc inspect: the capture holds no packets", file=sys.stderr)
    return 0


def _run_live(args: argparse.Namespace, opts: Options, match) -> int:
    """stdin or -i: every message shown (and flushed) as soon as it is decoded."""
    from .live import NoCaptureTool, decode_stream, run_interface
    from .pcap_io import CaptureError, ReadStats, open_capture

    out = Output(args, sys.stdout, match, live=True)

    def emit(m: Message) -> None:
        out.number(m)
        out.show(m)

    if args.iface:
        try:
            rc = run_interface(args.iface, args.port, opts, emit, out.first_packet)
        except NoCaptureTool as e:
            print(f"hydra-rpc inspect: {e}", file=sys.stderr)
            return 1
        out.finish()
        return rc
    stats = ReadStats()
    try:
        f, magic = open_capture("-")
        with f:
            decode_stream(f, magic, opts, emit, out.first_packet, stats)
    except CaptureError as e:
        print(f"hydra-rpc inspect: stdin: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    except (OSError, EOFError) as e:
        print(f"hydra-rpc inspect: stdin: read stopped: {e}; showing what was read", file=sys.stderr)
    out.finish()
    if stats.truncated_file:
        print("hydra-rpc inspect: the capture on stdin ends inside a packet record (cut short?)", file=sys.stderr)
    return 0


def _run_bytes(args: argparse.Namespace, opts: Options, match) -> int:
    from .hexinput import HexError, parse_hex

    if args.raw:
        data = sys.stdin.buffer.read()
    else:
        try:
            data = parse_hex(sys.stdin.read())
        except HexError as e:
            print(f"hydra-rpc inspect: --hex: {e}", file=sys.stderr)
            return 1
    out = Output(args, sys.stdout, match, live=False)
    messages: list[Message] = []
    opts.one_direction = True
    session = Session(opts, messages.append)
    # 59 48 starts Hydra requests and 0E a ggml HELLO; anything else is taken as Hydra responses
    # (a ggml response stream cannot be decoded without the commands it answers).
    direction, proto = args.direction, opts.decode_as
    if direction == "auto":
        direction = "request" if data[:2] == b"\x59\x48" or data[:1] == b"\x0e" else "response"
    if proto is None:
        proto = "ggml" if direction == "request" and data[:1] == b"\x0e" else "hydra"
    session.open(0, ("client", 0), ("server", 0), syn_seen=True, proto=proto)
    d = "c2s" if direction == "request" else "s2c"
    session.data(0, d, data, None)
    session.finish()
    for m in messages:
        out.number(m)
    for m in messages:
        out.show(m)
    out.finish()
    return 0


def _run_tap(args: argparse.Namespace, opts: Options, match) -> int:
    from .pcap_io import PcapWriter
    from .tap import Tap

    out = Output(args, sys.stdout, match, live=True)

    def emit(m: Message) -> None:
        out.number(m)
        out.show(m)

    session = Session(opts, emit)
    writer_file = open(args.write, "wb") if args.write else None  # noqa: SIM115 - closed below
    pcap = PcapWriter(writer_file) if writer_file else None

    async def main() -> int:
        tap = Tap(args.listen, args.upstream, session, pcap, on_event=lambda s: print(s, file=sys.stderr, flush=True))
        try:
            await tap.start()
        except OSError as e:
            print(f"hydra-rpc inspect: cannot listen on {args.listen[0]}:{args.listen[1]}: {e}", file=sys.stderr)
            return 1
        host, port = tap.address
        print(f"hydra-rpc inspect tap listening on {host}:{port} → {args.upstream[0]}:{args.upstream[1]}",
              file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await tap.close()
        print(f"hydra-rpc inspect tap: forwarded {tap.bytes['c2s']} bytes up, {tap.bytes['s2c']} bytes down",
              file=sys.stderr, flush=True)
        return 0

    try:
        rc = asyncio.run(main())
    finally:
        if pcap is not None:
            pcap.close()
        if writer_file is not None:
            writer_file.close()
    out.finish()
    return rc

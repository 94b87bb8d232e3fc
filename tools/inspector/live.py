"""Captures read while they are being written: a pcap piped in (``tcpdump -U -w - … | hydra-rpc
inspect -``) and ``-i IFACE``, which runs that capture itself through tcpdump or dumpcap.

A message is shown as soon as its last byte is decoded, so the output follows the traffic;
a capture file, read whole, is instead shown in capture order at the end (a request before
its response even when their streams interleave).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import BinaryIO

from .model import Message
from .pcap_io import CaptureError, ReadStats, peek, read_segments
from .reassembly import Reassembler
from .session import Options, Session

INSTALL_HINT = ("`apt-get install tcpdump` (or tshark, for dumpcap); without either, record through the tap: "
                "hydra-rpc inspect --listen HOST:PORT --upstream HOST:PORT")


class NoCaptureTool(Exception):
    """Neither tcpdump nor dumpcap is installed."""


def capture_filter(ports: Iterable[int]) -> str:
    """The BPF filter of ``-i``: TCP, to the ``--port`` ports when given."""
    ports = sorted(set(ports))
    return "tcp" + (f" and ({' or '.join(f'port {p}' for p in ports)})" if ports else "")


def capture_command(iface: str, ports: Iterable[int], which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """The command that writes a live capture of ``iface`` to stdout, packet by packet."""
    bpf = capture_filter(ports)
    if which("tcpdump"):  # -U: write each packet as it arrives, not a 4 KiB buffer at a time
        return ["tcpdump", "-i", iface, "-U", "-s", "0", "-w", "-", bpf]
    if which("dumpcap"):
        return ["dumpcap", "-i", iface, "-q", "-P", "-w", "-", "-f", bpf]
    raise NoCaptureTool(f"-i needs tcpdump or dumpcap, and neither is installed: {INSTALL_HINT}")


def decode_stream(f: BinaryIO, magic: bytes, opts: Options, emit: Callable[[Message], None],
                  on_first_ts: Callable[[float], None], stats: ReadStats) -> None:
    """Decode a capture as it arrives: each message is emitted once complete. Raises
    CaptureError for input that is not a capture."""
    session = Session(opts, emit)
    reasm = Reassembler(opts.server_ports)
    first = True
    try:
        for seg in read_segments(f, stats, magic):
            if first:
                on_first_ts(seg.ts)
                first = False
            for ev in reasm.add(seg):
                session.handle(ev)
    finally:
        for ev in reasm.finish():
            session.handle(ev)
        session.finish()


def run_interface(iface: str, ports: Sequence[int], opts: Options, emit: Callable[[Message], None],
                  on_first_ts: Callable[[float], None]) -> int:
    """``-i IFACE``: capture through tcpdump/dumpcap until interrupted (or the tool stops).
    Exit status 1 when the tool cannot capture (its own message is on stderr)."""
    cmd = capture_command(iface, ports)
    print(f"hydra-rpc inspect: capturing on {iface} with {cmd[0]} (filter {cmd[-1]!r}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)  # its stderr is ours
    stats = ReadStats()
    try:
        magic, f = peek(proc.stdout, 4)
        if not magic:  # the tool stopped before its file header: no such interface, no permission
            proc.wait()
            print(f"hydra-rpc inspect: {cmd[0]} exited with status {proc.returncode} before capturing (see its "
                  "message above; capturing usually needs root or CAP_NET_RAW)", file=sys.stderr)
            return 1
        decode_stream(f, magic, opts, emit, on_first_ts, stats)
    except KeyboardInterrupt:
        pass
    except CaptureError as e:
        print(f"hydra-rpc inspect: {cmd[0]}: {e}", file=sys.stderr)
        return 1
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 0

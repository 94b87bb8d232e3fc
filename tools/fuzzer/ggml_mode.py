"""``--protocol ggml``: malformed ggml-RPC through a passthrough, to check the *proxy*.

The target is a port that hands connections starting with 0x0E to an upstream rpc-server
(our server with ``--ggml-rpc-upstream``/``--ggml-rpc-embedded``, or the fork's merged
port). The upstream is fragile (docs/protocol.md §14: it aborts on many malformed inputs),
so this mode needs ``--i-know-upstream-may-crash``; cases that are most likely to take the
upstream down (huge sizes, bad tensors) come last in the sweep.

Oracles: the case connection must end (after our half-close the proxy must pass the close
on and close too: no hang), replies must be well-framed ``[u64 size][payload]`` (a HELLO
reply 28 or 3 bytes), a fresh HELLO must still be answered (proxy + upstream alive), the
Hydra side of the same port must still answer INFO (the proxy never takes it down), and a
spawned target must still run.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from codec import ggml as G
from codec.enums import Status

from .cases import Case, Message, Outcome
from .oracles import Baseline, after_case, probe_info
from .responses import Closed, Conn, Inbox, Stalled
from .schedule import rng_for
from .target import Target

HELLO = G.encode_hello_request()
MAX_REPLY = 1 << 30
U64 = struct.Struct("<Q")


def _frame(cmd: int, payload: bytes = b"", size: int | None = None) -> bytes:
    return bytes((cmd,)) + U64.pack(len(payload) if size is None else size) + payload


def _tensor(**kw) -> bytes:
    return G.encode_rpc_tensor(G.RpcTensor(**kw))


def _sweep() -> list[tuple[str, str, bytes]]:
    """(generator, note, bytes), the safest first: framing and handshake, then commands, then
    the inputs upstream has crashed on before."""
    out: list[tuple[str, str, bytes]] = [
        ("hello", "valid HELLO", HELLO),
        ("hello", "legacy (size 0) HELLO", _frame(G.Cmd.HELLO)),
        ("hello", "HELLO size 23", _frame(G.Cmd.HELLO, bytes(23))),
        ("hello", "HELLO size 25", _frame(G.Cmd.HELLO, bytes(25))),
        ("hello", "HELLO caps all 0xff", _frame(G.Cmd.HELLO, b"\xff" * 24)),
        ("hello", "HELLO twice", HELLO + HELLO),
    ]
    out += [("hello.truncated", f"HELLO cut after {n} bytes", HELLO[:n]) for n in (1, 5, 9, 20, 32)]
    out += [("first_cmd", f"cmd {c} before HELLO", _frame(c, struct.pack("<I", 0))) for c in range(0x14) if c != 0x0E]
    after = [
        ("GET_ALIGNMENT", _frame(G.Cmd.GET_ALIGNMENT, struct.pack("<I", 0))),
        ("GET_ALIGNMENT no device", _frame(G.Cmd.GET_ALIGNMENT)),
        ("GET_ALIGNMENT 5 bytes", _frame(G.Cmd.GET_ALIGNMENT, bytes(5))),
        ("DEVICE_COUNT", _frame(G.Cmd.DEVICE_COUNT)),
        ("DEVICE_COUNT with payload", _frame(G.Cmd.DEVICE_COUNT, b"x")),
        ("GET_DEVICE_MEMORY device 99", _frame(G.Cmd.GET_DEVICE_MEMORY, struct.pack("<I", 99))),
        ("GET_MAX_SIZE device 0xffffffff", _frame(G.Cmd.GET_MAX_SIZE, struct.pack("<I", 0xFFFFFFFF))),
        ("unknown cmd 0x14", _frame(0x14)), ("unknown cmd 0xff", _frame(0xFF, b"abc")),
        ("cmd NONE (18)", _frame(G.Cmd.NONE)),
        ("FREE_BUFFER of a made-up pointer", _frame(G.Cmd.FREE_BUFFER, U64.pack(0x4141414141))),
        ("BUFFER_GET_BASE of 0", _frame(G.Cmd.BUFFER_GET_BASE, U64.pack(0))),
        ("frame cut inside the size", _frame(G.Cmd.GET_ALIGNMENT, struct.pack("<I", 0))[:5]),
        ("frame cut inside the payload", _frame(G.Cmd.GET_ALIGNMENT, struct.pack("<I", 0))[:11]),
        ("ALLOC_BUFFER 0 bytes", _frame(G.Cmd.ALLOC_BUFFER, struct.pack("<IQ", 0, 0))),
        ("GRAPH_COMPUTE null node (upstream regression test)",
         _frame(G.Cmd.GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1, 0, 0))),
        ("SET_TENSOR buffer 0 with data", _frame(G.Cmd.SET_TENSOR, _tensor(id=1, buffer=0, data=0x1234,
                                                                           ne=(4, 1, 1, 1)) + bytes(9) + b"data")),
        ("INIT_TENSOR made-up buffer", _frame(G.Cmd.INIT_TENSOR, _tensor(id=1, buffer=0x4141, ne=(4, 1, 1, 1)))),
        ("SET_TENSOR size 2**40 declared", _frame(G.Cmd.SET_TENSOR, b"", size=1 << 40)),
    ]
    out += [("after_hello", f"HELLO, then {note}", HELLO + data) for note, data in after]
    return out


_SWEEP = _sweep()


def case_at(seed: int, index: int) -> Case:
    if index < len(_SWEEP):
        gen, note, data = _SWEEP[index]
        return Case(seed, index, "sweep", f"ggml.{gen}", note, protocol="ggml", messages=[Message(data)])
    rng = rng_for(seed, index)
    gen, note, data = rng.choice(_SWEEP[: len(_SWEEP) - 3])  # the random phase leaves the worst ones alone
    data = bytearray(data)
    if len(data) > 10 and rng.random() < 0.7:
        pos = rng.randrange(9, len(data))
        data[pos] ^= 1 << rng.randrange(8)
        note += f", bit flip @{pos}"
    else:
        data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20)))
        note += ", junk appended"
    return Case(seed, index, "random", f"ggml.{gen}", note, protocol="ggml", messages=[Message(bytes(data))])


@dataclass
class GgmlBaseline:
    hello_size: int
    hydra: Baseline | None  # the same port's Hydra side, when it has one


async def _hello(target: Target, deadline: float) -> int:
    """Size of the HELLO reply payload on a fresh connection (raises if there is none)."""
    conn = await Conn.open(target.host, target.port, deadline)
    try:
        conn.writer.write(HELLO)
        await conn.writer.drain()
        size = U64.unpack(await conn.inbox.take(8, deadline))[0]
        await conn.inbox.take(min(size, 64), deadline)
        return size
    finally:
        await conn.close()


async def take_ggml_baseline(target: Target, deadline: float) -> GgmlBaseline:
    size = await _hello(target, deadline)
    hydra = None
    try:
        r = await probe_info(target, deadline)
        hydra = Baseline(r.status, bool(r.meta and "engine" in r.meta)) if r.status == Status.OK else None
    except (OSError, TimeoutError, Closed, Stalled, Exception):  # a bare rpc-server has no Hydra side
        hydra = None
    return GgmlBaseline(size, hydra)


async def run_ggml_case(case: Case, target: Target, base: GgmlBaseline, cfg) -> Outcome:
    out = Outcome(sent=[m.data for m in case.messages])
    rss0 = target.peak_rss_kb()
    data = b"".join(m.data for m in case.messages)
    try:
        reader, writer = await target.connect(cfg.deadline)
    except (OSError, TimeoutError):
        reader = None
    if reader is not None:
        inbox = Inbox(reader)
        try:
            writer.write(data)
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            await _read_replies(inbox, data, cfg.deadline, out)
        except (ConnectionError, OSError):
            pass
        finally:
            out.received = bytes(inbox.raw)
            writer.close()
            await inbox.close()
    if base.hydra is not None:
        await after_case(target, base.hydra, cfg.deadline, out, rss0, cfg.max_rss_growth_mb * 1024)
    elif target.exit_info() is not None:
        out.exit = target.exit_info()
        out.fail("crash", f"the target exited: {out.exit}")
    if not any(f.oracle == "crash" for f in out.failures):
        try:
            size = await _hello(target, cfg.deadline)
            if size != base.hello_size:
                out.fail("liveness", f"a fresh HELLO got a {size}-byte reply, at the start {base.hello_size}")
        except (OSError, TimeoutError, Closed, Stalled) as e:
            out.fail("liveness", f"a fresh HELLO was not answered (upstream or proxy down?): {type(e).__name__} {e}")
    return out


async def _read_replies(inbox: Inbox, sent: bytes, deadline: float, out: Outcome) -> None:
    first_is_hello = sent[:33] == HELLO
    n = 0
    while True:
        try:
            head = await inbox.take(8, deadline, None, "a ggml reply size")
        except Closed as e:
            if e.partial:
                out.fail("malformed", f"the connection closed inside a ggml reply header ({e.partial} of 8 bytes)")
            elif n == 0 and first_is_hello:
                # Every rpc-server answers a valid HELLO before it reads on: a proxy that closes
                # without passing that reply on dropped it (e.g. tore down on our half-close).
                out.fail("desync", "the connection closed without the upstream's reply to a valid HELLO",
                         rule="dropped-reply")
            return
        except Stalled:
            out.fail("hang", f"after {n} replies and our half-close, the connection stayed open for {deadline}s")
            return
        size = U64.unpack(head)[0]
        if size > MAX_REPLY:
            out.fail("malformed", f"ggml reply {n} declares {size} bytes")
            return
        try:
            body = await inbox.take(size, deadline, None, "a ggml reply")
        except Closed:
            out.fail("malformed", f"the connection closed inside ggml reply {n} ({size} bytes declared)")
            return
        except Stalled:
            out.fail("hang", f"ggml reply {n} stopped arriving")
            return
        out.responses.append({"ggml_reply": n, "size": size, "head_hex": body[:16].hex()})
        if n == 0 and first_is_hello and size not in (3, 28):
            out.fail("malformed", f"the HELLO reply is {size} bytes (3 or 28 expected)")
        n += 1

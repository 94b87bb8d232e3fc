"""``--protocol ggml``: malformed ggml-RPC through a passthrough, to check the *proxy*.

The target is a port that hands connections starting with 0x0E to an rpc-server: best our
server with ``--ggml-rpc-embedded`` (a guarded child process per session), or with
``--ggml-rpc-upstream``, or the fork's merged port. An unguarded rpc-server aborts on many of
these inputs (docs/ggml.md), so the mode needs ``--i-know-upstream-may-crash``. The cases
(tools/fuzzer/ggml_cases.py): handshake and framing, then what has crashed llama.cpp's
rpc-server, sent against a real buffer of the session; the random phase mutates those,
inside the tensors too.

Oracles: the Hydra side of the same port must still answer INFO (nothing on the ggml side
may take the engine down) and a spawned target must still run; the case connection must end
(after our half-close the proxy passes the close on: no hang); replies must be well-framed
``[u64 size][payload]`` (a HELLO reply 28 or 3 bytes); a fresh HELLO must still be answered.
An embedded child that died (the server logs it) is noted, not a finding: it was contained.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from codec import ggml as G
from codec.enums import Status

from .cases import Case, Message, Outcome
from .ggml_cases import BUFFER_SIZE, HELLO, SWEEP, V, mutate, resolve
from .oracles import Baseline, after_case, probe_info
from .responses import Closed, Conn, Inbox, Stalled
from .schedule import rng_for
from .target import Target

MAX_REPLY = 1 << 30
RSP = G.RESPONSE_HEADER_STRUCT
CHILD_DIED = re.compile(rb"ggml child (\d+) died: (\S+)")


def case_at(seed: int, index: int) -> Case:
    if index < len(SWEEP):
        gen, note, data = SWEEP[index]
        return Case(seed, index, "sweep", f"ggml.{gen}", note, protocol="ggml", messages=[Message(data)])
    rng = rng_for(seed, index)
    gen, note, data = rng.choice(SWEEP)
    data, how = mutate(rng, data, gen == "buffer")
    return Case(seed, index, "random", f"ggml.{gen}", f"{note}, {how}", protocol="ggml", messages=[Message(data)])


@dataclass
class GgmlBaseline:
    hello_size: int
    hydra: Baseline | None  # the same port's Hydra side, when it has one
    log_seen: int = 0  # bytes of the spawned target's log already searched for child deaths


async def _hello(target: Target, deadline: float) -> int:
    """Size of the HELLO reply payload on a fresh connection (raises if there is none)."""
    conn = await Conn.open(target.host, target.port, deadline)
    try:
        conn.writer.write(HELLO)
        await conn.writer.drain()
        size = RSP.unpack(await conn.inbox.take(RSP.size, deadline))[0]
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
            if case.generator == "ggml.buffer":
                data = resolve(data, *await _prelude(writer, inbox, cfg.deadline))
            writer.write(data)
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            await _read_replies(inbox, data, cfg.deadline, out)
        except (ConnectionError, OSError):
            pass
        except (Closed, Stalled) as e:
            out.fail("liveness", f"the prelude (HELLO, ALLOC_BUFFER, BUFFER_GET_BASE) was not answered: {e}")
        finally:
            out.received = bytes(inbox.raw)
            writer.close()
            await inbox.close()
    if base.hydra is not None:
        await after_case(target, base.hydra, cfg.deadline, out, rss0, cfg.max_rss_growth_mb * 1024)
    elif target.exit_info() is not None:
        out.exit = target.exit_info()
        out.fail("crash", f"the target exited: {out.exit}")
    _child_deaths(target, base, out)
    if not any(f.oracle == "crash" for f in out.failures):
        try:
            size = await _hello(target, cfg.deadline)
            if size != base.hello_size:
                out.fail("liveness", f"a fresh HELLO got a {size}-byte reply, at the start {base.hello_size}")
        except (OSError, TimeoutError, Closed, Stalled) as e:
            out.fail("liveness", f"a fresh HELLO was not answered (upstream or proxy down?): {type(e).__name__} {e}")
    return out


async def _prelude(writer, inbox: Inbox, deadline: float) -> tuple[int, int]:
    """HELLO, ALLOC_BUFFER and BUFFER_GET_BASE on the case's connection: the buffer its markers name."""

    async def call(cmd: int, **fields) -> dict:
        writer.write(G.encode_request(cmd, G.request_layout(cmd, V).build(fields)))
        await writer.drain()
        size = RSP.unpack(await inbox.take(RSP.size, deadline))[0]
        return G.parse_response_payload(cmd, await inbox.take(size, deadline), V)

    writer.write(HELLO)
    await writer.drain()
    await inbox.take(RSP.unpack(await inbox.take(RSP.size, deadline, None, "HELLO"))[0], deadline)
    ptr = (await call(G.Cmd.ALLOC_BUFFER, device=0, size=BUFFER_SIZE))["remote_ptr"]
    inbox.raw.clear()
    return ptr, (await call(G.Cmd.BUFFER_GET_BASE, remote_ptr=ptr))["base_ptr"]


def _child_deaths(target: Target, base: GgmlBaseline, out: Outcome) -> None:
    """With --ggml-rpc-embedded the server logs a child that died. The engine survives that by
    design, so it is a note, not a finding: the guard let through something the rpc-server dies of."""
    log = target.log_dir / "target.log" if target.log_dir is not None else None
    if log is None or not log.exists():
        return
    with open(log, "rb") as f:
        f.seek(base.log_seen)
        new = f.read()
    base.log_seen += len(new)
    for pid, how in CHILD_DIED.findall(new):
        out.notes.append(f"ggml child died: {how.decode()} (pid {pid.decode()}, contained)")


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
        size = RSP.unpack(head)[0]
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

"""What must hold after every case, and the expectations they are judged against.

The expectation comes from the bytes we sent, parsed the way a correct server must parse
them (``plan_frames``): N complete requests → up to N responses, in order, each one
well-formed (or a close instead, after which nothing more). What follows them decides the
rest: nothing (clean — the connection must still serve a follow-up INFO), an unfinished
request (partial — we half-close; the server may refuse it once, then must close), or
bytes that are not a request (garbage — no reply to them, then a close).

Oracles (finding classes in ``cases.CLASSES``):

* liveness  — a fresh connection's INFO answers as it did at the start, within the deadline;
* crash     — the spawned target is still running / the port still accepts connections;
* hang      — the fuzzed connection answers or closes within the deadline (a slow generation
              that still makes progress, seen through STATE_META, is not a hang);
* desync    — no reply to bytes that were not a request, no extra replies, the follow-up
              INFO on the same connection answers like the baseline, replies match requests;
* resource  — (spawn) the target's peak RSS does not jump during one case (unless a reply in it
              accepted a setting that rebuilds the context or model: then the jump is what the
              request asked for, reported as expected, not as a finding);
* traceback — (spawn) the target logs no Python traceback while it handles the case;
* bad-status / malformed — every reply has a defined status and sane framing.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from codec.dialects import Dialect, decode_dialect
from codec.enums import Op, Status, status_name
from codec.frames import split_frames
from codec.framing import encode_request

from .cases import Outcome
from .explain import config_asked, exception_type, requested_growth, tracebacks
from .responses import Closed, Conn, Malformed, Resp, Stalled, read_response
from .target import Target, exit_text

_STOI = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
PROBE = encode_request(Op.INFO, b"", b"", b"probe")
GENERATION_OPS = (Op.PREFILL, Op.DECODE)
DEFINED_STATUSES = frozenset(int(s) for s in Status)


def stoi(key: bytes) -> int | None:
    """The slot id a C++ ``std::stoi`` would read from ``key`` (None if it would throw)."""
    m = _STOI.match(key)
    if not m:
        return None
    v = int(m.group(1))
    return v if -2**31 <= v < 2**31 else None


@dataclass
class SentFrame:
    op: int
    key: bytes
    payload: bytes

    @property
    def dialect(self) -> Dialect | None:
        """What the server reads this as (a PIN DECODE may be answered with a stream of pieces)."""
        return decode_dialect(self.payload) if self.op == Op.DECODE and self.payload else None


@dataclass
class Plan:
    frames: list[SentFrame] = field(default_factory=list)
    tail: str = "clean"  # clean | partial | garbage
    tail_bytes: int = 0


def plan_frames(data: bytes) -> Plan:
    """Split what we sent into the requests a correct server sees (no limits assumed)."""
    split = split_frames(data)
    return Plan([SentFrame(f.header.op, f.key, f.payload) for f in split.frames], split.tail, len(split.rest))


@dataclass
class Baseline:
    """How the target answers INFO on a fresh connection when all is well."""

    status: int
    has_engine: bool
    config_generation: int | None = None  # what INFO said at the start (a live target's settings)
    n_slots: int | None = None  # INFO's slots_total (fixed for the process: --parallel is a start flag)

    def matches(self, r: Resp) -> bool:
        return r.status == self.status and (not self.has_engine or bool(r.meta and "engine" in r.meta))

    def describe(self) -> str:
        return f"{status_name(self.status)}{' with an engine key' if self.has_engine else ''}"


async def probe_info(target: Target, deadline: float) -> Resp:
    conn = await Conn.open(target.host, target.port, deadline)
    try:
        return await conn.request(PROBE, deadline)
    finally:
        await conn.close()


async def take_baseline(target: Target, deadline: float) -> Baseline:
    r = await probe_info(target, deadline)
    meta = r.meta if isinstance(r.meta, dict) else {}
    slots = meta.get("slots_total")
    return Baseline(r.status, "engine" in meta, meta.get("config_generation"),
                    slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else None)


def slot_reached(key: bytes, n_slots: int | None) -> int | None:
    """The slot a key names: an id at or past the slot count maps onto the slots modulo it, as
    the C++ engine maps it (docs/protocol.md, keys)."""
    slot = stoi(key)
    return slot % n_slots if slot is not None and slot >= 0 and n_slots else slot


def judge(resp: Resp, frame: SentFrame | None, baseline: Baseline, out: Outcome) -> None:
    """Per-reply checks: defined status, sane meta, and the reply fits its request."""
    if resp.status not in DEFINED_STATUSES:
        out.fail("bad-status", f"reply with undefined status 0x{resp.status:02x}")
    if resp.meta_error:
        out.fail("malformed", f"{status_name(resp.status)} meta is not a JSON object: {resp.meta_error}"
                              f" (meta {resp.meta_raw[:120]!r})", rule="meta")
    if frame is None or resp.status != Status.OK or resp.meta is None:
        return
    if frame.op == Op.INFO and baseline.has_engine and "engine" not in resp.meta:
        out.fail("desync", "an OK reply to INFO has no 'engine' key: it answers another request", rule="mismatch")
    if frame.op == Op.STATE_META and "slot_id" in resp.meta:
        want = slot_reached(frame.key, baseline.n_slots)
        if want is not None and resp.meta["slot_id"] != want:
            out.fail("desync", f"STATE_META for slot {want} answered with slot_id {resp.meta['slot_id']}",
                     rule="mismatch")


# How long a half-closed connection is watched for its close after the follow-up INFO: a server
# that keeps half-closed connections open costs each clean case this much, one that closes none.
FOLLOWUP_EOF_WAIT = 0.1


async def followup_probe(conn_inbox, writer, baseline: Baseline, deadline: float, out: Outcome) -> None:
    """The fuzzed connection stayed open: the next request on it must be answered normally."""
    try:
        writer.write(PROBE)
        await asyncio.wait_for(writer.drain(), deadline)
        r = await read_response(conn_inbox, deadline)
    except Closed:
        out.fail("desync", "the connection closed instead of answering the follow-up INFO", rule="followup-closed")
        return
    except (Stalled, TimeoutError):
        out.fail("desync", "the follow-up INFO on the same connection was not answered (eaten as payload?)",
                 rule="followup")
        return
    except Malformed as e:
        out.fail("desync", f"the follow-up INFO got a broken reply: {e}", rule="followup")
        return
    except (ConnectionError, OSError) as e:
        out.fail("desync", f"the follow-up INFO failed: {e}", rule="followup-closed")
        return
    if r.status not in DEFINED_STATUSES:
        out.fail("desync", f"the follow-up INFO got status 0x{r.status:02x}: the stream is off", rule="followup")
    elif not baseline.matches(r):
        out.fail("desync", f"the follow-up INFO got {status_name(r.status)} (meta {r.meta_raw[:100]!r}), "
                           f"a fresh connection gets {baseline.describe()}", rule="followup")
    else:
        await _only_reply(conn_inbox, writer, out)


async def _only_reply(conn_inbox, writer, out: Outcome) -> None:
    """The follow-up's reply must be the last one. An unasked-for reply that came late (after the
    follow-up was sent) can look like the INFO's, the real one then following it: half-close,
    and a server that closes in turn shows whether anything else was still on its way."""
    try:
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        return
    if await conn_inbox.wait_eof(FOLLOWUP_EOF_WAIT) == "data":
        out.fail("desync", "another reply followed the follow-up INFO's: the replies are out of step with the "
                           "requests", rule="extra")


async def progressing(target: Target, frame: SentFrame, deadline: float, window: float,
                      arrived=lambda: False, interval: float = 0.25) -> bool | None:
    """Is the engine still working on this (generation) request? STATE_META of its slot every
    ``interval`` for up to ``window`` seconds: True as soon as anything moved (or the reply
    started to arrive, or while INFO shows a reload being built), False if nothing moved for the
    whole window while the slot is busy, None if META cannot tell or the slot is idle (an idle
    slot owes us a reply: a hang)."""
    slot = stoi(frame.key) if frame.key else 0
    if frame.op not in GENERATION_OPS or slot is None:
        return None
    key = str(slot).encode()
    loop = asyncio.get_running_loop()
    end = loop.time() + window
    first = None
    while True:
        if arrived():
            return True
        try:
            conn = await Conn.open(target.host, target.port, deadline)
            try:
                r = await conn.request(encode_request(Op.STATE_META, key), deadline)
            finally:
                await conn.close()
        except (OSError, TimeoutError, Closed, Stalled, Malformed):
            return None
        if r.status != Status.OK or not r.meta:
            return None
        snap = {k: r.meta.get(k) for k in ("n_past", "tokens_processed", "is_processing", "operation")}
        if not snap.get("is_processing") and snap.get("operation") in (None, "idle"):
            # a request whose hydra_config the engine is loading waits for that reload, not a slot
            return True if await _reloading(target, deadline) else None
        if first is None:
            first = snap
        elif snap != first:
            return True
        if loop.time() >= end:
            # a job held while the engine builds the context a CONFIGURE asked for is slow, not hung
            return await _reloading(target, deadline)
        await asyncio.sleep(interval)


async def _reloading(target: Target, deadline: float) -> bool:
    """Whether INFO shows a reload being built (a context of the size a request asked for can
    take many seconds: slow, not a hang)."""
    try:
        r = await probe_info(target, deadline)
    except (OSError, TimeoutError, Closed, Stalled, Malformed):
        return False
    reload = r.meta.get("reload") if r.status == Status.OK and r.meta else None
    return isinstance(reload, dict) and reload.get("state") in ("loading", "draining")


class Hang(Exception):
    """No reply, no close, and (for generation requests) no visible progress."""


class Slow(Exception):
    """Still making progress when we stopped waiting: not a finding."""


async def await_reply(inbox, frame: SentFrame, target: Target, deadline: float, max_wait: float, *,
                      until: float | None = None) -> Resp:
    """One reply to ``frame``. A generation request may take longer than ``deadline`` while
    STATE_META shows its slot moving (up to ``max_wait``); anything else that stalls is a Hang."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + max_wait
    while True:
        try:
            return await read_response(inbox, deadline, dialect=frame.dialect, until=until)
        except Stalled as e:
            if getattr(e, "mid", False):
                raise Hang(f"the reply to {frame_name(frame)} stopped half-way for {deadline}s") from None
            moving = await progressing(target, frame, deadline, deadline,
                                       arrived=lambda: bool(inbox.buf) or inbox.eof)
            if not moving:
                raise Hang(f"no reply to {frame_name(frame)} and no close within {deadline}s"
                           + (" while its slot made no progress" if moving is False else "")) from None
            if loop.time() >= give_up:
                raise Slow(f"slow: the engine was still working on {frame_name(frame)} after {max_wait:.0f}s; "
                           f"gave up") from None


def frame_name(frame: SentFrame) -> str:
    from codec.enums import op_name

    return f"{op_name(frame.op)} (key {frame.key[:16]!r}, {len(frame.payload)} payload bytes)"


async def after_case(target: Target, baseline: Baseline, deadline: float, out: Outcome,
                     rss_before: int | None = None, max_rss_growth_kb: int = 1 << 20) -> None:
    """Process still running (spawn), a fresh connection still served (liveness), and no
    memory jump (spawn): a server that allocates what a length field claims shows it here
    long before it runs out of memory."""
    await _liveness(target, baseline, deadline, out)
    after = target.peak_rss_kb()
    if rss_before is not None and after is not None and after - rss_before > max_rss_growth_kb:
        grew = (f"the target's peak RSS grew by {(after - rss_before) // 1024} MiB during this case "
                f"({rss_before // 1024} → {after // 1024} MiB)")
        asked = requested_growth(out.responses) or config_asked(out.sent)
        if asked:  # a CONFIGURE n_ctx=16777216 the target accepted: it did what it was told
            out.expected.append(f"requested-memory: {grew}; {asked}")
        else:
            out.fail("resource", grew)


def check_log(target: Target, offset: int | None, out: Outcome) -> None:
    """A Python traceback the (spawned) target logged while it handled this case is a finding of
    its own: an exception the server did not expect, even when its reply looked fine."""
    if offset is None:
        return
    found = tracebacks(target.log_since(offset))
    if not found:
        return
    exc, where, text = found[-1]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    out.traceback = "\n\n".join(t for _, _, t in found)[-8000:]
    out.fail("traceback", f"the target logged a traceback: {exc}" + (f" at {where}" if where else "") + more,
             rule=exception_type(exc))


DYING_GRACE = 15.0  # a spawned target that stopped answering may be dying (llama.cpp prints a backtrace first)
RELOAD_SETTLE = 60.0  # how long a reload the case started may take before the verdict


async def _died(target: Target, out: Outcome, grace: float) -> bool:
    """Did the spawned target exit (waiting up to ``grace`` for it)? Records the crash."""
    loop = asyncio.get_running_loop()
    end = loop.time() + (grace if target.spawn else 0.1)
    while True:
        info = target.exit_info()
        if info is not None:
            out.exit = info
            rss = target.last_peak_rss_kb()
            out.fail("crash", f"the target exited ({exit_text(info)}"
                              + (f"; peak RSS {rss // 1024} MiB" if rss is not None else "") + f"): {info}")
            return True
        if loop.time() >= end:
            return False
        await asyncio.sleep(0.1)


def _reload_pending(r: Resp) -> bool:
    reload = r.meta.get("reload") if isinstance(r.meta, dict) else None
    return isinstance(reload, dict) and reload.get("state") in ("loading", "draining")


async def _liveness(target: Target, baseline: Baseline, deadline: float, out: Outcome) -> None:
    """A fresh connection's INFO answers as at the start. A reload the case started (CONFIGURE,
    hydra_config) is waited for first: a value that kills the process at build time is this
    case's finding, not the next one's."""
    if await _died(target, out, 0.0):
        return
    loop = asyncio.get_running_loop()
    settle_until = loop.time() + RELOAD_SETTLE
    while True:
        try:
            r = await probe_info(target, deadline)
        except (ConnectionRefusedError, ConnectionResetError) as e:
            if not await _died(target, out, DYING_GRACE):
                out.fail("crash", f"the target port refuses connections: {e}")
            return
        except (OSError, TimeoutError, Closed, Stalled, Malformed) as e:
            if not await _died(target, out, DYING_GRACE):
                out.fail("liveness", f"INFO on a fresh connection failed: {type(e).__name__}: {e}")
            return
        if not (target.spawn and _reload_pending(r)) or loop.time() >= settle_until:
            break
        await asyncio.sleep(0.1)
    if not baseline.matches(r):
        out.fail("liveness", f"INFO on a fresh connection got {status_name(r.status)} "
                             f"(meta {r.meta_raw[:100]!r}), at the start it got {baseline.describe()}")

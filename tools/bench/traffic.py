"""Client-side traffic shared by scenarios: PIN streaming decodes, pollers, rate timelines.

All timestamps are ``common.now()`` of this process, so the latency of a poll and the
arrival of a decoded piece are on the same clock.
"""
from __future__ import annotations

import asyncio
import json
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from codec import payloads as P
from codec.enums import Op, Status, op_name
from hydra_rpc.client import HydraClient

from .common import BenchError, now


def messages_for(i: int) -> list[dict[str, str]]:
    """A short chat per stream (distinct per slot, so no two streams share a prompt)."""
    return [{"role": "user", "content": f"Stream {i}: tell me a long story about the sea and its ships."}]


@dataclass
class PinRun:
    """One PIN streaming DECODE as the client saw it."""

    slot: int
    t_send: float
    t_head: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each piece
    status: int = Status.OK
    error: str = ""

    @property
    def tokens(self) -> int:
        return len(self.times)

    def decode_rate(self) -> float | None:
        """tok/s from the first to the last piece (prefill and connection setup excluded)."""
        t = self.times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None

    def e2e_rate(self) -> float | None:
        return len(self.times) / (self.times[-1] - self.t_send) if self.times else None

    def check(self, wanted: int) -> "PinRun":
        """Raise unless the stream was accepted and produced a rate (≥ 2 pieces)."""
        if self.status != Status.OK:
            raise BenchError(f"PIN DECODE on slot {self.slot} refused: {self.error}")
        if len(self.times) < 2:
            raise BenchError(f"slot {self.slot}: the stream ended after {len(self.times)} of {wanted} tokens "
                             "(the model's end of generation); these benchmarks need a model that keeps generating")
        return self


async def remote_poller(host: str, port: int, interval: float, seconds: float, start_at: float | None = None) -> list:
    """One STATE_META poller about slot 0 in a process of its own under SCHED_RR where permitted
    (``workers pollers``): a stand-in for a coordinator on another host, whose reads this host's
    compute does not delay. Returns its polls as ``[t, ms, status]`` on this process's clock."""
    from .procs import run_worker

    out = await run_worker("pollers", {"host": host, "port": port, "n": 1, "interval": interval, "seconds": seconds,
                                       "slots": 1, "index0": 0, "of": 1, "realtime": True, "timeline": True,
                                       **({"start_at": start_at} if start_at is not None else {})},
                           timeout=seconds * 10 + 60)
    return out["polls"]


MIN_PIECES = 2  # a rate needs two pieces: a cap never ends a stream before it has them


async def pin_decode(host: str, port: int, slot: int, n_predict: int, messages: list | None, *,
                     until: float | None = None, stop: asyncio.Event | None = None,
                     seconds: float | None = None) -> PinRun:
    """PIN DECODE ``{"n_predict", "messages"}``: head ``OK,0,0`` then ``[u32 len][piece]`` until EOF.

    ``until`` (a ``now()`` value), ``seconds`` after the first piece, or ``stop`` ends the
    stream early: closing the connection is how a PIN client cancels, and the server frees the
    slot at its next step — so an accepted stream is only returned once its slot is idle again,
    and the next request on the slot is not refused BUSY. ``until``/``seconds`` wait for
    ``MIN_PIECES`` first: on a busy host the prefill alone may outlast the cap.
    """
    c = await HydraClient.connect(host, port)
    run = PinRun(slot, now())
    try:
        await c.send(Op.DECODE, str(slot), P.encode_json_decode(n_predict, messages))
        head = await c.read_response()
        run.t_head = now()
        run.status = head.status
        if head.status != Status.OK:
            run.error = str(head.meta)
            return run
        async for _piece in c.pin_pieces():
            t = now()
            run.times.append(t)
            if seconds is not None and until is None:
                until = t + seconds
            if (stop is not None and stop.is_set()) or \
                    (until is not None and t >= until and len(run.times) >= MIN_PIECES):
                break
    finally:
        await c.close()
    await wait_slot_idle(host, port, slot)
    return run


async def wait_slot_idle(host: str, port: int, slot: int, timeout: float = 60.0) -> None:
    """Poll STATE_META until ``slot`` is processing nothing (a cancelled stream has been freed)."""
    deadline = now() + timeout
    while True:
        meta = await request_ok(host, port, Op.STATE_META, str(slot))
        if not meta.get("is_processing") and not meta.get("is_transferring"):
            return
        if now() > deadline:
            raise BenchError(f"slot {slot} still busy {timeout:.0f} s after its stream was closed: {meta}")
        await asyncio.sleep(0.005)


def rate_timeline(times: list[float], t0: float, bin_s: float = 0.1) -> list[tuple[float, float]]:
    """(bin centre relative to ``t0``, tok/s) for the pieces in ``times``.

    Each bin's count is divided by the part of the bin the stream covered, and bins the stream
    covered for less than half are left out: a stream ending early in its last bin is not a
    drop in the rate.
    """
    if len(times) < 2:
        return []
    a, b = times[0] - t0, times[-1] - t0
    first, last = int(a // bin_s), int(b // bin_s)
    counts = [0] * (last - first + 1)
    for t in times:
        counts[int((t - t0) // bin_s) - first] += 1
    out = []
    for i, c in enumerate(counts):
        lo, hi = (first + i) * bin_s, (first + i + 1) * bin_s
        covered = min(hi, b) - max(lo, a)
        if covered >= bin_s / 2:
            out.append((round((lo + hi) / 2, 4), c / covered))
    return out


def tokens_between(times: list[float], a: float, b: float) -> int:
    return sum(1 for t in times if a <= t < b)


def steady_rate(streams: list[list[float]]) -> float | None:
    """Tokens of all ``streams`` (each a list of token arrival times) per second, inside the
    window where every one of them was producing — from the last stream's first token to the
    first stream's last — so prefills and stragglers do not blur it."""
    if not streams or any(len(t) < 2 for t in streams):
        return None
    a = max(t[0] for t in streams)
    b = min(t[-1] for t in streams)
    if b <= a:
        return None
    return sum(tokens_between(t, a, b) for t in streams) / (b - a)


@dataclass
class Poll:
    t: float  # send time (``now()``)
    ms: float  # round trip; for a failed poll, the time until it failed
    op: str
    status: int  # wire status, or -1 for a timeout / connection error
    generation: int | None
    reload_state: str | None = None


class Poller:
    """Sends ``ops`` in turn on ONE connection, ``interval`` seconds apart, until ``stop`` is set.

    A poll that fails (timeout, reset) is recorded with status -1 and the connection is
    reopened, so a stall shows up as a few long samples, not as a hole in the timeline.
    """

    def __init__(self, host: str, port: int, ops: list[tuple[int, str]], interval: float, timeout: float = 10.0,
                 phase: float = 0.0):
        self.host, self.port = host, port
        self.ops = ops
        self.interval = interval
        self.timeout = timeout
        self.phase = phase  # seconds to wait before the first poll
        self.polls: list[Poll] = []

    async def run(self, stop: asyncio.Event) -> list[Poll]:
        client: HydraClient | None = None
        i = 0
        if self.phase:
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(stop.wait(), self.phase)
        try:
            while not stop.is_set():
                op, key = self.ops[i % len(self.ops)]
                i += 1
                t0 = now()
                try:
                    if client is None:
                        client = await HydraClient.connect(self.host, self.port, timeout=self.timeout)
                        t0 = now()
                    r = await client.request(op, key, timeout=self.timeout)
                    meta = r.meta or {}
                    reload = meta.get("reload") if isinstance(meta.get("reload"), dict) else {}
                    self.polls.append(Poll(t0, (now() - t0) * 1000, op_name(op), r.status,
                                           meta.get("config_generation"), reload.get("state")))
                except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
                    self.polls.append(Poll(t0, (now() - t0) * 1000, op_name(op), -1, None, type(e).__name__))
                    if client is not None:
                        await client.close()
                    client = None
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
        finally:
            if client is not None:
                await client.close()
        return self.polls


def poll_columns(polls: list[Poll], t0: float) -> dict[str, list[Any]]:
    """Raw poll samples as JSON columns (time relative to ``t0`` in s, latency in ms)."""
    return {"t": [round(p.t - t0, 5) for p in polls], "ms": [round(p.ms, 4) for p in polls],
            "op": [p.op for p in polls], "status": [p.status for p in polls],
            "generation": [p.generation for p in polls], "reload_state": [p.reload_state for p in polls]}


def latencies(polls: list[Poll], a: float = float("-inf"), b: float = float("inf"), ok_only: bool = True) -> list[float]:
    return [p.ms for p in polls if a <= p.t < b and (p.status == Status.OK or not ok_only)]


async def request_ok(host: str, port: int, op: int, key: str = "", payload: bytes = b"",
                     timeout: float = 120.0) -> dict[str, Any]:
    """One request on a fresh connection; its meta, or BenchError if the status is not OK."""
    async with await HydraClient.connect(host, port) as c:
        r = await c.request(op, key, payload, timeout=timeout)
    if r.status != Status.OK:
        raise BenchError(f"{op_name(op)} {key!r} answered {r!r}")
    return r.meta or {}


async def wait_generation(host: str, port: int, generation: int, timeout: float = 120.0) -> dict[str, Any]:
    """Poll INFO until ``config_generation`` reaches ``generation`` (a staged reload is live)."""
    deadline = now() + timeout
    while now() < deadline:
        info = await request_ok(host, port, Op.INFO)
        if info.get("config_generation", 0) >= generation:
            return info
        if (info.get("reload") or {}).get("state") in ("failed", "dropped"):
            raise BenchError(f"reload to generation {generation} failed: {info['reload']}")
        await asyncio.sleep(0.02)
    raise BenchError(f"config generation {generation} not live after {timeout:.0f}s")


async def sse_events(http: Any, url: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """POST ``body`` to an OpenAI streaming endpoint and yield (arrival time, event) for each
    ``data:`` event before ``[DONE]``; a refusal is a BenchError with the server's answer."""
    async with http.post(url, json=body) as r:
        if r.status != 200:
            raise BenchError(f"{url} answered {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield now(), json.loads(line[6:])

"""Slow-sender mode (``--slow-senders N``): slowloris in the background of a run.

N connections each send a request one byte every ``interval`` seconds — a STATE_PUT whose
header promises 64 KiB, so it cannot end by arriving — and reconnect when the server closes
them. Meanwhile the other cases run, so every liveness probe is made under their load: a
server that lets dribblers keep their connections locks everyone else out at
``--max-connections``. A dribbler the server has not closed ``deadline`` seconds after it
connected is a finding (``hang``, rule ``slow-sender``): progress-based deadlines (a minimum
rate, not only a stall timeout between bytes) must cut it.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from codec.enums import Op
from codec.framing import encode_request_header

from .cases import Case, Message
from .target import Target

PROMISED = 64 * 1024
FRAME = encode_request_header(Op.STATE_PUT, 1, PROMISED, 0) + b"0" + b"\x03" * PROMISED


@dataclass
class SlowStats:
    connections: int = 0
    cut: int = 0  # closed by the server before the deadline
    longest_s: float = 0.0
    overstayed: list[float] = field(default_factory=list)  # lifetimes past the deadline

    def to_json(self) -> dict:
        return {"connections": self.connections, "cut_by_server": self.cut, "longest_s": round(self.longest_s, 1),
                "overstayed": len(self.overstayed)}


def slow_case(seed: int, interval: float) -> Case:
    """The dribbler as a case file can replay (it is sent the same way, one byte at a time)."""
    return Case(seed, -1, "slow", "slow-sender", f"STATE_PUT promising {PROMISED} bytes, one byte every "
                f"{interval:g} s", messages=[Message(FRAME, "dribble", 1, interval * 1000)])


class SlowSenders:
    def __init__(self, target: Target, count: int, interval: float = 1.0, deadline: float = 120.0):
        self.target, self.count, self.interval, self.deadline = target, count, interval, deadline
        self.stats = SlowStats()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._dribbler()) for _ in range(self.count)]

    async def settle(self) -> None:
        """Wait until every dribbler has been judged once (cut, or kept past the deadline), so a
        short run still gives each its verdict."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.deadline + 5 * self.interval + 5.0
        while self.stats.cut + len(self.stats.overstayed) < self.count and loop.time() < end:
            await asyncio.sleep(self.interval / 4)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _dribbler(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                reader, writer = await self.target.connect(5.0)
            except (OSError, TimeoutError):
                await asyncio.sleep(self.interval)  # the target is restarting, or full: try again
                continue
            self.stats.connections += 1
            t0 = loop.time()
            closed = asyncio.ensure_future(reader.read())  # b"" or an error: the server closed it
            try:
                for i in range(len(FRAME)):
                    if closed.done() or loop.time() - t0 > self.deadline:
                        break
                    writer.write(FRAME[i:i + 1])
                    await asyncio.wait({closed}, timeout=self.interval)
            except (ConnectionError, OSError):
                pass
            finally:
                lifetime = loop.time() - t0
                self.stats.longest_s = max(self.stats.longest_s, lifetime)
                if closed.done():
                    self.stats.cut += 1
                elif lifetime > self.deadline:
                    self.stats.overstayed.append(lifetime)
                if closed.done() and not closed.cancelled():
                    closed.exception()  # a reset is a close too
                closed.cancel()
                writer.close()

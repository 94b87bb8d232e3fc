"""How many compute threads a decode step should use now.

ggml's compute threads meet at a barrier after every operation of the graph: when one of
them waits for a core, the others wait for it. With as many threads as cores, every other
busy process on the host (or our own loader building a shadow model) preempts one of them
and decode falls 10–30× (docs/performance.md, busy-host and reload-stall). So the step
uses the configured count minus the cores other processes keep busy (read from /proc every
half second), minus one while a model loads beside it, and never fewer than one. The count
goes down at once and back up only after two samples agree, so a short burst elsewhere does
not make it flap.

A sample covers the time since the previous one, and an idle engine takes none: the first
step after an idle spell would judge the host by what ran while it idled (another server's
request that ended a second ago), drop a thread it needs and take a second to get it back
(9 % of a 200-token request on Gemma 3 270M, docs/performance.md). So the engine says when it
goes idle (:meth:`ComputeThreads.idle`); the first step after it runs with the count it had,
the second starts a new window, and the window is sampled after ``FRESH_S`` of the new work.
The window starts at the second step, not the first, because reading /proc/stat on a core
that has just woken takes 25–40 µs, on the path of the request's first token.
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable

from .status import ComputeThreadsInfo

SAMPLE_S = 0.5
RESTORE_SAMPLES = 2
FRESH_S = 0.1  # the first sample after an idle spell: 10 ticks of each core, a busy one shows
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # jiffies per second


def _read_busy() -> tuple[float, float] | None:
    """(busy jiffies of all CPUs, CPU jiffies of this process), or None off Linux. Raw reads:
    5 µs instead of pathlib's 47, and it runs on the event loop before a step."""
    try:
        fd = os.open("/proc/stat", os.O_RDONLY)
        try:
            head = os.read(fd, 512)  # the first line sums every CPU
        finally:
            os.close(fd)
        cpu = [int(x) for x in head.split(b"\n", 1)[0].split()[1:8]]
        own = os.times()  # times(2): this process's utime + stime, as /proc/self/stat has them
    except (OSError, ValueError, IndexError):
        return None
    if len(cpu) < 5:
        return None
    busy = sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait
    return float(busy), (own.user + own.system) * _TICK


class OtherLoad:
    """Cores used by other processes since the previous call, from /proc/stat and times(2)."""

    def __init__(self, read: Callable[[], tuple[float, float] | None] = _read_busy,
                 clock: Callable[[], float] = time.monotonic):
        self._read, self._clock = read, clock
        self._last = (self._clock(), self._read())

    def sample(self) -> float | None:
        t, busy = self._clock(), self._read()
        (t0, busy0), self._last = self._last, (t, busy)
        if busy is None or busy0 is None or t <= t0:
            return None
        others = (busy[0] - busy0[0]) - (busy[1] - busy0[1])
        return max(0.0, others / _TICK / (t - t0))


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class ComputeThreads:
    """The thread count for the next step (``want``), given the configured count."""

    def __init__(self, configured: int, cores: int, load: OtherLoad | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.configured = max(1, configured)
        self.cores = max(1, cores)
        self._load = load or OtherLoad()
        self._clock = clock
        self._next = clock() + SAMPLE_S
        self._by_load = self.configured
        self._higher = 0  # consecutive samples that allowed more threads than now
        self._idle = False  # the engine ran nothing since the last want(): the window is history
        self._baseline_due = False  # the first step after an idle spell ran: the next starts the window
        self.others = 0.0  # cores other processes used in the last sample
        # what an operator reads on /metrics (engine.status.ComputeThreadsInfo): the count the
        # last step used, how often it went down, and the seconds of work below the configured
        # count (from one step's want() to the next; an idle spell is not work)
        self.current = self.configured
        self.lowered = 0
        self.reduced_s = 0.0
        self._since: float | None = None

    def idle(self) -> None:
        """The engine has nothing to run; the step after its next starts a new window."""
        self._idle = True
        self._account(self._clock())
        self._since = None

    def want(self, loading: bool) -> int:
        now = self._clock()
        self._account(now)
        self._since = now
        if self._idle:
            # what others did while we idled says nothing of now: the count stays (a host busy
            # before the spell is likely still busy) and the next step starts a new window
            self._idle, self._baseline_due = False, True
            self._higher = 0
        elif self._baseline_due:
            self._baseline_due = False
            self._load.sample()
            self._next = now + FRESH_S
        elif now >= self._next:
            self._next = now + SAMPLE_S
            self._resample()
        n = max(1, min(self.configured, self._by_load - (1 if loading else 0)))
        if n < self.current:
            self.lowered += 1
        self.current = n
        return n

    def info(self) -> ComputeThreadsInfo:
        """What /metrics shows of the count (engine.status.ComputeThreadsInfo)."""
        return ComputeThreadsInfo(self.configured, self.current, round(self.others, 3), self.lowered,
                                  round(self.reduced_s, 3))

    def _account(self, now: float) -> None:
        if self._since is not None and self.current < self.configured:
            self.reduced_s += max(0.0, now - self._since)

    def _resample(self) -> None:
        others = self._load.sample()
        if others is None:
            return
        self.others = others
        fit = max(1, min(self.configured, self.cores - math.floor(others + 0.5)))
        if fit < self._by_load:
            self._by_load, self._higher = fit, 0
        elif fit > self._by_load:
            self._higher += 1
            if self._higher >= RESTORE_SAMPLES:
                self._by_load, self._higher = fit, 0
        else:
            self._higher = 0

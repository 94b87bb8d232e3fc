"""Recent rates (tokens/s, steps/s) over a short window, read from immutable snapshots.

The owner of a counter calls :meth:`RateWindow.record` as the counter grows; a sample is kept
at most every ``SAMPLE_EVERY`` seconds and only about ``WINDOW`` seconds' worth, so a frozen
copy is a handful of pairs. The rate is computed when it is *read* (:func:`rate`), not when the
snapshot was published: a counter that stopped moving shows its rate falling to 0 even when
nothing republishes (a job paused on its client, a wedged step).
"""
from __future__ import annotations

from collections import deque

WINDOW = 2.0  # seconds
SAMPLE_EVERY = 0.25

Samples = tuple[tuple[float, int], ...]  # (monotonic time, counter value), oldest first


class RateWindow:
    __slots__ = ("_samples",)

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def restart(self, count: int, now: float) -> None:
        """A new phase starts counting from ``count`` now (earlier samples say nothing about it)."""
        self._samples.clear()
        self._samples.append((now, count))

    def record(self, count: int, now: float) -> None:
        s = self._samples
        if not s or now - s[-1][0] >= SAMPLE_EVERY:
            s.append((now, count))
        while len(s) > 1 and now - s[1][0] >= WINDOW:  # the oldest is only needed while the next is in the window
            s.popleft()

    def frozen(self) -> Samples:
        return tuple(self._samples)


def rate(samples: Samples, count: int, now: float) -> float:
    """Units per second over the last ``WINDOW`` seconds: the growth of the counter since the
    oldest sample inside the window, over the time since that sample. 0 with no sample in it."""
    for t0, c0 in samples:
        if now - t0 <= WINDOW:
            span = now - t0
            return (count - c0) / span if span > 0 else 0.0
    return 0.0

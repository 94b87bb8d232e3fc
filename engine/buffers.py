"""A large buffer kept resident between transfers and leased to one transfer at a time.

Copying a multi-hundred-MiB state into fresh memory pays a page fault per page (on this
machine kind ~110 ms at 256 MiB, and very variable under a VM); a buffer whose pages are
already resident does not. The price is that the largest buffer used so far stays
allocated — so a buffer above ``idle_keep`` bytes is dropped once it has been idle for
``idle_after`` seconds: back-to-back transfers keep it, one large transfer an hour ago does
not hold its memory until the next. A transfer that finds the buffer leased gets a fresh
one of its own.
"""
from __future__ import annotations

import asyncio
import mmap
from typing import Callable

Buffer = bytearray | mmap.mmap

LAZY_MIN = 1 << 20  # below this a bytearray: its zero-filling costs less than a mapping
#: from this size a mapping asks for transparent huge pages (numpy's own threshold for its arrays)
HUGE_MIN = 4 << 20


def lazy_buffer(n: int) -> Buffer:
    """``n`` writable bytes whose memory is committed only as it is written.

    A length field is a claim, not a fact: a 70-byte request saying "4 GiB follow" must
    cost neither 4 GiB of RAM nor seconds of zero-filling; an anonymous mapping reserves
    address space only (and gives its pages back to the system when dropped). And the pages
    are faulted in by whoever writes them: by llama.cpp inside a call that has let the GIL
    go, where a bytearray's zero-filling holds it — ~23 ms for a 63 MB recurrent state on the
    project's 2-core machine kind, during which the event loop answers nothing.

    From ``HUGE_MIN`` on, the mapping asks for transparent huge pages (``MADV_HUGEPAGE``, what
    a kernel set to ``madvise`` waits for, as numpy asks for its large arrays): a 2 MiB page
    is one fault where 4 KiB pages are 512, and faults were most of a new checkpoint's cost —
    a 63 MB capture into a new buffer took 37 ms, 5.6 into a reused one. Still written on
    demand: a claimed size costs nothing until its bytes arrive.
    """
    if n < LAZY_MIN:
        return bytearray(n)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    buf = mmap.mmap(-1, n, flags=flags)
    if n >= HUGE_MIN and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
            pass
    return buf


def release_tail(buf: mmap.mmap, n: int) -> None:
    """Give the pages of ``buf`` past its first ``n`` bytes back to the system (an anonymous
    mapping's read as zeros if touched again, a private file mapping's as the file). A reused
    mapping keeps every page an earlier, larger write touched, and the byte counts that judge
    what fits see only the ``n`` bytes in use."""
    start = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
    if start < len(buf) and hasattr(mmap, "MADV_DONTNEED"):
        buf.madvise(mmap.MADV_DONTNEED, start, len(buf) - start)


class LeasedBuffer:
    def __init__(self, make: Callable[[int], Buffer] = lazy_buffer, keep_max: int = 8 << 30,
                 idle_keep: int = 64 << 20, idle_after: float = 10.0):
        self._make = make
        self._buf: Buffer | None = None
        self._leased = False
        self._idle_timer: asyncio.TimerHandle | None = None
        self.keep_max = keep_max  # never retain more than this
        self.idle_keep = idle_keep  # retained however long it is idle
        self.idle_after = idle_after

    @property
    def retained(self) -> int:
        """Bytes held between transfers."""
        return len(self._buf) if self._buf is not None else 0

    def lease(self, size: int) -> tuple[memoryview, Callable[[], None]]:
        """A writable view of ``size`` bytes and the function that gives it back."""
        if self._leased or size > self.keep_max:
            return memoryview(self._make(size)), _noop
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._buf is None or len(self._buf) < size:
            self._buf = None  # drop the smaller one first: never hold both
            self._buf = self._make(size)
        self._leased = True
        return memoryview(self._buf)[:size], self._release

    def _release(self) -> None:
        self._leased = False
        if self.retained <= self.idle_keep:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to wait on: do not keep it at all
            self._buf = None
            return
        self._idle_timer = loop.call_later(self.idle_after, self.clear)

    def clear(self) -> None:
        """Drop the retained buffer, unless a transfer holds it now."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if not self._leased:
            self._buf = None


def _noop() -> None:
    pass

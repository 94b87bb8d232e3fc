"""Results of merged DECODE v3 requests, kept for ``GET /v1/decode/{id}``.

Bounded like the C++ (``HYDRA_DECODE_RESULT_TTL_S`` = 300 s, ``HYDRA_DECODE_RESULT_MAX`` =
1024): the oldest entry is evicted first; expired entries disappear on access. A job whose
entry is evicted while it runs is cancelled: nobody can read its result any more. A job also
stops after ``budget`` seconds (``HYDRA_DECODE_BUDGET_S``, default 120 s, at most the TTL),
so a detached generation cannot hold its slot longer than that whoever asked for it.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.jobs import GenResult, JobHandle


@dataclass
class DecodeEntry:
    id: int
    slot: int
    job: JobHandle
    created: float = field(default_factory=time.monotonic)
    state: str = "running"  # running | done | failed | cancelled
    result: GenResult | None = None
    error: str = ""
    n_past_after_restore: int = 0
    model: str = ""

    def stop(self, why: str) -> bool:
        """Cancel the job if it still runs (its partial result stays readable); True if it did."""
        if self.state != "running" or self.job.cancelled:
            return False
        self.job.cancel()
        self.error = why
        return True


class DecodeResults:
    def __init__(self, ttl: float = 300.0, max_entries: int = 1024, budget: float = 120.0):
        """``ttl``, ``max_entries``, ``budget``: ServerConfig's ``decode_result_*`` settings."""
        self.ttl = ttl
        self.max_entries = max_entries
        self.budget = min(budget, self.ttl)  # a job may not outlive the result it writes
        self._ids = itertools.count(1)
        self._entries: OrderedDict[int, DecodeEntry] = OrderedDict()

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, entry: DecodeEntry) -> None:
        self._expire()
        self._entries[entry.id] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)[1].stop("evicted: more than the newest results are kept")

    def get(self, decode_id: int) -> DecodeEntry | None:
        self._expire()
        return self._entries.get(decode_id)

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            first = next(iter(self._entries.values()))
            if now - first.created <= self.ttl:
                break
            self._entries.popitem(last=False)[1].stop("expired")

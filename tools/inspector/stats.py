"""``--stats``: per-op counts, status counts, latency percentiles per op, bytes per direction.

Like tshark's ``-z srt`` and ``-z conv`` in one table. Latency is the request's first byte to
the response's last byte (what a client waits), per op, over paired requests only.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

from .model import Message


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0–100) of an already sorted list."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class Stats:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # (proto, op) → count
        self.statuses: Counter[tuple[str, str]] = Counter()  # (proto, status) → count
        self.status_by_op: Counter[tuple[str, str, str]] = Counter()
        self.latency: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.bytes: Counter[tuple[str, str]] = Counter()  # (proto, direction) → bytes
        self.messages: Counter[str] = Counter()
        self.streams: dict[str, set[int]] = defaultdict(set)
        self.incomplete = 0
        self.notes: Counter[str] = Counter()
        self.unanswered = 0

    def add(self, m: Message) -> None:
        self.messages[m.proto] += 1
        self.streams[m.proto].add(m.stream)
        self.bytes[(m.proto, m.direction)] += m.length
        for sev, _ in m.notes:
            self.notes[sev] += 1
        if not m.complete:
            self.incomplete += 1
        op = m.attrs.get("op")
        if m.direction == "request" and op is not None:
            self.requests[(m.proto, str(op))] += 1
            if m.peer is None and m.attrs.get("answered", True) is not False:
                self.unanswered += 1
        if m.direction == "response":
            st = m.attrs.get("status")
            if st is not None:
                self.statuses[(m.proto, str(st))] += 1
            req_op = m.peer.attrs.get("op") if m.peer is not None else op
            if req_op is not None and st is not None:
                self.status_by_op[(m.proto, str(req_op), str(st) if st is not None else "-")] += 1
            lat = m.latency_ms
            if lat is not None and req_op is not None:
                self.latency[(m.proto, str(req_op))].append(lat)

    def as_dict(self) -> dict[str, Any]:
        ops = []
        for (proto, op), n in sorted(self.requests.items()):
            lat = sorted(self.latency.get((proto, op), []))
            ops.append({"proto": proto, "op": op, "requests": n, "answered": len(lat),
                        "statuses": {st: c for (p, o, st), c in sorted(self.status_by_op.items())
                                     if p == proto and o == op},
                        "latency_ms": {"p50": percentile(lat, 50), "p95": percentile(lat, 95),
                                       "p99": percentile(lat, 99), "max": lat[-1] if lat else None}})
        return {
            "messages": dict(self.messages),
            "streams": {p: len(s) for p, s in self.streams.items()},
            "ops": ops,
            "statuses": {f"{p}:{s}": n for (p, s), n in sorted(self.statuses.items())},
            "bytes": {f"{p}:{d}": n for (p, d), n in sorted(self.bytes.items())},
            "incomplete_messages": self.incomplete,
            "unanswered_requests": self.unanswered,
            "notes": dict(self.notes),
        }

    def render(self) -> str:
        d = self.as_dict()
        out = ["=" * 96, "hydra-rpc inspect statistics", "=" * 96]
        out.append("messages: " + ", ".join(f"{p} {n} in {d['streams'].get(p, 0)} streams"
                                            for p, n in sorted(d["messages"].items())) or "messages: none")
        out.append("")
        out.append(f"{'proto':6} {'op':22} {'count':>7} {'answered':>8} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9}"
                   f" {'max ms':>9}  statuses")
        for row in d["ops"]:
            lat = row["latency_ms"]
            cells = [f"{v:9.3f}" if v is not None else f"{'-':>9}" for v in (lat["p50"], lat["p95"], lat["p99"], lat["max"])]
            sts = " ".join(f"{k}={v}" for k, v in row["statuses"].items())
            out.append(f"{row['proto']:6} {row['op']:22} {row['requests']:7} {row['answered']:8} {' '.join(cells)}  {sts}")
        out.append("")
        out.append("status counts: " + (", ".join(f"{k}={v}" for k, v in d["statuses"].items()) or "none"))
        out.append("bytes by direction: " + (", ".join(f"{k}={v}" for k, v in d["bytes"].items()) or "none"))
        out.append(f"incomplete messages: {d['incomplete_messages']}, unanswered requests: "
                   f"{d['unanswered_requests']}, expert notes: {d['notes'] or 0}")
        out.append("=" * 96)
        return "\n".join(out)

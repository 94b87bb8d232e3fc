"""The Hydra header codec's hot path against the construct definition it is proven equal to.

    python -m tools.bench.header_codec [--rounds 5] [--n 20000] [--out FILE]

``codec/framing.py`` decodes and encodes the 16-byte request and 12-byte response headers with
``struct``; the construct ``Struct``s beside them are the declarative definitions a property test
holds them equal to. This measures what the hot path buys: each round times both on the same
headers, alternating in short slices, in one process, by this thread's CPU time (so a busy host
shifts neither), and reports
per-call microseconds, the ratio per round and its spread. Prints (and with ``--out`` writes)
one JSON object.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from codec.framing import (MAGIC, REQUEST_HEADER, RESPONSE_HEADER, decode_request_header, decode_response_header,
                           encode_request_header, encode_response_header)

REQ = encode_request_header(3, 2, 4096, 0)
RESP = encode_response_header(0, 120, 4096)


def _per_call_us(fn: Callable[[], Any], n: int) -> float:
    # this thread's CPU time, not the wall clock: a preemption by another process is not counted
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t0) / n * 1e6


CASES: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    # name: (hot path, construct definition)
    "request decode": (lambda: decode_request_header(REQ), lambda: REQUEST_HEADER.parse(REQ)),
    "request encode": (lambda: encode_request_header(3, 2, 4096, 0),
                       lambda: REQUEST_HEADER.build(dict(magic=MAGIC, op=3, flags=0, key_len=2, payload_len=4096,
                                                         trace_len=0))),
    "response decode": (lambda: decode_response_header(RESP), lambda: RESPONSE_HEADER.parse(RESP)),
    "response encode": (lambda: encode_response_header(0, 120, 4096),
                        lambda: RESPONSE_HEADER.build(dict(status=0, meta_len=120, payload_len=4096))),
}


def _round(fast: Callable[[], Any], declared: Callable[[], Any], n: int, slices: int = 20) -> dict[str, float]:
    """Both timed in alternating slices, so that a burst of load elsewhere falls on both."""
    struct_s = construct_s = 0.0
    per_slice = max(1, n // slices)
    for _ in range(slices):
        struct_s += _per_call_us(fast, per_slice) * per_slice
        construct_s += _per_call_us(declared, max(1, per_slice // 10)) * max(1, per_slice // 10)
    struct_us = struct_s / (per_slice * slices)
    construct_us = construct_s / (max(1, per_slice // 10) * slices)
    return {"struct_us": round(struct_us, 3), "construct_us": round(construct_us, 3),
            "ratio": round(construct_us / struct_us, 1)}


def run(rounds: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "rounds": rounds, "calls_per_round": n, "cases": {}}
    for name, (fast, declared) in CASES.items():
        assert fast() is not None and declared() is not None
        per_round = [_round(fast, declared, n) for _ in range(rounds)]
        ratios = [r["ratio"] for r in per_round]
        out["cases"][name] = {"rounds": per_round, "ratio_median": statistics.median(ratios),
                              "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=20000, help="hot-path calls per round (construct: a tenth)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    result = run(args.rounds, args.n)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

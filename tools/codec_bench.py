"""Header codec micro-benchmark: the ``struct`` hot path vs the construct definitions.

    python -m tools.codec_bench [--n 200000] [--json]

Decodes and re-encodes Hydra request (16 B) and response (12 B) headers both ways and
prints operations per second side by side with the ratio. The two paths are proven
equal by tests/test_codec_framing.py; this shows why the hot path uses ``struct``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from codec.framing import (
    REQUEST_HEADER,
    RESPONSE_HEADER,
    decode_request_header,
    decode_response_header,
    encode_request_header,
    encode_response_header,
)

REQ = encode_request_header(0x42, 1, 123456, 4)
RESP = encode_response_header(0, 0xABCDEF, 1 << 20)


def _struct_round_trip(n: int) -> None:
    for _ in range(n):
        h = decode_request_header(REQ)
        encode_request_header(h.op, h.key_len, h.payload_len, h.trace_len, h.flags)
        r = decode_response_header(RESP)
        encode_response_header(r.status, r.meta_len, r.payload_len)


def _construct_round_trip(n: int) -> None:
    for _ in range(n):
        REQUEST_HEADER.build(REQUEST_HEADER.parse(REQ))
        RESPONSE_HEADER.build(RESPONSE_HEADER.parse(RESP))


def _rate(fn, n: int, reps: int) -> tuple[float, float]:
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(n)
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates), (max(rates) - min(rates)) / statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.codec_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="round trips per repetition (struct path)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    _struct_round_trip(1000)
    _construct_round_trip(100)
    s, s_spread = _rate(_struct_round_trip, args.n, args.reps)
    c, c_spread = _rate(_construct_round_trip, max(1, args.n // 20), args.reps)
    out = {"struct_round_trips_per_s": round(s), "construct_round_trips_per_s": round(c),
           "ratio_struct_over_construct": round(s / c, 1), "spread": {"struct": round(s_spread, 3),
                                                                      "construct": round(c_spread, 3)},
           "reps": args.reps, "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0],
           "what": "decode+encode of one request header and one response header"}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'path':<10} {'round trips/s':>14}  spread")
        print(f"{'struct':<10} {out['struct_round_trips_per_s']:>14,}  ±{s_spread:.0%}")
        print(f"{'construct':<10} {out['construct_round_trips_per_s']:>14,}  ±{c_spread:.0%}")
        print(f"struct is {out['ratio_struct_over_construct']}× faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""meta-under-decode: STATE_META latency about a slot while that very slot decodes.

The C++ engine queues STATE_META behind the running DECODE (it times out at 5 s); here it
reads a published snapshot. One slot streams a long PIN decode with compute threads on
every core, while a poller on its own connection asks STATE_META about the same slot every
few ms. Baseline: the same poller against the idle server, interleaved round by round.
The server runs ``--fixed-threads``: decode stays on every core even when this client's own
CPU use would make it give one up (the budget's condition).
"""
from __future__ import annotations

import asyncio

from codec.enums import Op

from .common import BenchContext, Result, Row, interleaved, now, rounded, spread, summarize
from .procs import HydraServer
from .traffic import Poller, latencies, messages_for, pin_decode, poll_columns, rate_timeline

NAME = "meta-under-decode"
POLL_INTERVAL = 0.002  # "every few ms"
CTX = 16384


async def _round(srv: HydraServer, kind: str, seconds: float) -> dict:
    stop = asyncio.Event()
    poller = Poller(srv.host, srv.port, [(Op.STATE_META, "0")], POLL_INTERVAL)
    t0 = now()
    polling = asyncio.create_task(poller.run(stop))
    run = None
    if kind == "busy":
        run = await pin_decode(srv.host, srv.port, 0, CTX - 256, messages_for(0), until=t0 + seconds)
    else:
        await asyncio.sleep(seconds)
    stop.set()
    polls = await polling
    out = {"kind": kind, "polls": polls, "t0": t0}
    if run is not None:
        run.check(CTX - 256)
        # only polls sent while tokens were flowing count as "during decode" (not the prefill)
        out.update(run=run, window=(run.times[0], run.times[-1]))
    else:
        out.update(window=(t0, now()))
    return out


async def run(ctx: BenchContext) -> Result:
    res = Result(NAME)
    idle_s, busy_s = ctx.pick(2.0, 0.6), ctx.pick(4.0, 1.5)
    res.config = {"model": ctx.models.busy, "threads": ctx.threads, "poll_interval_ms": POLL_INTERVAL * 1000,
                  "idle_seconds": idle_s, "busy_seconds": busy_s, "reps": ctx.reps, "ctx": CTX,
                  "priorities": "server defaults: event loop SCHED_RR where permitted, inference nice 0"}
    with HydraServer(["--model", ctx.models.busy, "--slots", "2", "--ctx", str(CTX),
                      "--threads", str(ctx.threads), "--fixed-threads"]) as srv:
        await pin_decode(srv.host, srv.port, 0, 64, messages_for(0))  # warm-up: graphs, buffers, caches
        await _round(srv, "idle", 0.3)
        rounds = [await _round(srv, kind, busy_s if kind == "busy" else idle_s)
                  for _, kind in interleaved(ctx.reps, ["idle", "busy"])]

    per_round = {"idle": [], "busy": []}
    pooled = {"idle": [], "busy": []}
    answered = errors = 0
    rates = []
    samples = []
    for r in rounds:
        a, b = r["window"]
        lat = latencies(r["polls"], a, b)
        pooled[r["kind"]] += lat
        per_round[r["kind"]].append(summarize(lat).get("p99"))
        entry = {"kind": r["kind"], "window": [round(a - r["t0"], 5), round(b - r["t0"], 5)],
                 "polls": poll_columns(r["polls"], r["t0"])}
        if r["kind"] == "busy":
            during = [p for p in r["polls"] if a <= p.t < b]
            answered += sum(1 for p in during if p.status == 0)
            errors += sum(1 for p in during if p.status != 0)
            rates.append(r["run"].decode_rate())
            entry.update(piece_times=rounded([t - r["t0"] for t in r["run"].times], 5),
                         tokens_per_s=rate_timeline(r["run"].times, r["t0"]))
        samples.append(entry)
    idle, busy = summarize(pooled["idle"]), summarize(pooled["busy"])
    res.samples = {"rounds": samples}
    res.summary = {"idle_ms": idle, "busy_ms": busy, "idle_p99_per_round": spread(per_round["idle"]),
                   "busy_p99_per_round": spread(per_round["busy"]), "answered_during_decode": answered,
                   "errors_during_decode": errors, "decode_tok_s": spread(rates)}
    p99 = busy.get("p99")
    res.rows = [
        Row("STATE_META p99 while its slot decodes", p99, "ms", idle.get("p99"), "idle server", "p99 < 1 ms",
            note=f"pooled over the rounds; {answered} answered, {errors} failed; decode "
                 f"{spread(rates)['median'] or 0:.0f} tok/s", limit=1.0, kind="max"
            ).with_spread(res.summary["busy_p99_per_round"]),
        Row("STATE_META p50 while its slot decodes", busy.get("p50"), "ms", idle.get("p50"), "idle server"),
        Row("STATE_META max while its slot decodes", busy.get("max"), "ms", idle.get("max"), "idle server"),
    ]
    return res

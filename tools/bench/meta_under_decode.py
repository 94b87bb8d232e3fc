"""meta-under-decode: STATE_META latency about a slot while that very slot decodes.

The C++ engine queues STATE_META behind the running DECODE (it times out at 5 s); here it
reads a published snapshot. One slot streams a long PIN decode with compute threads on
every core, while a poller on its own connection asks STATE_META about the same slot every
few ms. Baseline: the same poller against the idle server, interleaved round by round.
The server runs ``--fixed-threads``: decode stays on every core even when this client's own
CPU use would make it give one up (the budget's condition).

Two pollers ask at once, and both are reported. The budget's is a process of its own under
SCHED_RR where permitted (``workers pollers``, as in busy-host): it stands in for the
coordinator, which runs on another host — on this one, a normal-priority client waits for a
core held by a spinning compute thread before it even reads the answer, and that wait is the
client's, not the server's. The other is a normal-priority poller in this harness (which also
consumes the stream), reported beside it without a budget: what a client on the node sees.
"""
from __future__ import annotations

import asyncio
import time

from codec.enums import Op

from .common import BenchContext, Result, Row, interleaved, now, rounded, spread, summarize
from .procs import HydraServer
from .traffic import Poller, remote_poller, latencies, messages_for, pin_decode, poll_columns, rate_timeline

NAME = "meta-under-decode"
POLL_INTERVAL = 0.002  # "every few ms"
CTX = 16384


WORKER_START_S = 1.5  # the remote-like poller's process imports and connects before the round begins


async def _round(srv: HydraServer, kind: str, seconds: float) -> dict:
    # the remote-like poller outlasts the round; only its polls inside the window count
    remote = asyncio.create_task(remote_poller(srv.host, srv.port, POLL_INTERVAL, seconds + 4,
                                               time.time() + WORKER_START_S))
    await asyncio.sleep(WORKER_START_S)
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
    out = {"kind": kind, "polls": polls, "t0": t0, "remote_polls": await remote}
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

    # per poller ("remote": the budget's SCHED_RR process; "local": this harness), per kind
    pooled = {(w, k): [] for w in ("remote", "local") for k in ("idle", "busy")}
    per_round = {(w, k): [] for w in ("remote", "local") for k in ("idle", "busy")}
    answered = errors = 0
    rates = []
    samples = []
    for r in rounds:
        a, b = r["window"]
        remote = [(t, ms, st) for t, ms, st in r["remote_polls"] if a <= t < b]
        for who, lat in (("local", latencies(r["polls"], a, b)), ("remote", [ms for _, ms, st in remote if st == 0])):
            pooled[who, r["kind"]] += lat
            per_round[who, r["kind"]].append(summarize(lat).get("p99"))
        entry = {"kind": r["kind"], "window": [round(a - r["t0"], 5), round(b - r["t0"], 5)],
                 "polls": poll_columns(r["polls"], r["t0"]),
                 "remote_polls": [[round(t - r["t0"], 5), ms, st] for t, ms, st in remote]}
        if r["kind"] == "busy":
            answered += sum(1 for _, _, st in remote if st == 0)
            errors += sum(1 for _, _, st in remote if st != 0)
            errors += sum(1 for p in r["polls"] if a <= p.t < b and p.status != 0)
            rates.append(r["run"].decode_rate())
            entry.update(piece_times=rounded([t - r["t0"] for t in r["run"].times], 5),
                         tokens_per_s=rate_timeline(r["run"].times, r["t0"]))
        samples.append(entry)
    stats = {key: summarize(v) for key, v in pooled.items()}
    res.samples = {"rounds": samples}
    res.summary = {f"{who}_{kind}_ms": stats[who, kind] for who, kind in stats}
    res.summary.update({f"{who}_{kind}_p99_per_round": spread(v) for (who, kind), v in per_round.items()})
    res.summary.update(answered_during_decode=answered, errors_during_decode=errors, decode_tok_s=spread(rates))
    remote_busy, remote_idle = stats["remote", "busy"], stats["remote", "idle"]
    local_busy, local_idle = stats["local", "busy"], stats["local", "idle"]
    res.rows = [
        Row("STATE_META p99 while its slot decodes (remote-like poller: own process, SCHED_RR where permitted)",
            remote_busy.get("p99"), "ms", remote_idle.get("p99"), "idle server", "p99 < 1 ms",
            note=f"pooled over the rounds; {answered} answered, {errors} failed; decode "
                 f"{spread(rates)['median'] or 0:.0f} tok/s", limit=None if errors else 1.0, kind="max",
            ok=False if errors else None).with_spread(res.summary["remote_busy_p99_per_round"]),
        Row("STATE_META p50 while its slot decodes (remote-like poller)", remote_busy.get("p50"), "ms",
            remote_idle.get("p50"), "idle server"),
        Row("STATE_META max while its slot decodes (remote-like poller)", remote_busy.get("max"), "ms",
            remote_idle.get("max"), "idle server"),
        Row("STATE_META p99 while its slot decodes (a normal-priority poller on this host)", local_busy.get("p99"),
            "ms", local_idle.get("p99"), "idle server",
            note="includes the client's own wait for a core that a spinning compute thread holds"
            ).with_spread(res.summary["local_busy_p99_per_round"]),
    ]
    return res

"""busy-host: decode and STATE_META while other CPU-bound processes share the host.

K CPU-bound processes at the normal priority (K = usable cores: a node agent, exporters and
log shippers in production; here busy loops) run for the whole scenario. Candidate: the
server with its default priorities streams a PIN decode with compute threads on every core
while a poller asks STATE_META about the decoding slot every few ms. Baseline, same run,
same contention: the bare llama-cpp-python loop at the normal priority. Runs interleave.
The poller is a process of its own under SCHED_RR where permitted: it stands in for a client
on another host, whose reads this host's CPU-bound processes do not delay (a normal-priority
client here measures its own wait for a core as much as the server's).

Contrast variants (no budget, full runs only) show what each part of the scheme gives under
the same load: ``--fixed-threads`` (compute threads on every core whatever else runs) and
``--loop-priority normal`` (what a host that does not permit SCHED_RR gets). The older
default, ``--low-priority`` (inference at nice 19), is not run: beside K CPU-bound processes it
all but stops (a server took 30 s to start and 213 s for a 16-token warm-up), so one round would
outlast the scenario's bound; docs/performance.md keeps its earlier figures.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from .common import BenchContext, Result, Row, interleaved, now, ratio, spread, summarize
from .procs import HydraServer, run_worker
from .traffic import messages_for, remote_poller, pin_decode, rate_timeline

NAME = "busy-host"
POLL_INTERVAL = 0.002
CTX = 8192
# spins until its parent (the bench) is gone: it outlives no bench, however long the rounds take
HOG = "import os\nwhile os.getppid() == {parent}:\n    for _ in range(100_000):\n        pass\n"
DECODE_GOAL = 0.8  # server decode tok/s over the bare loop's, both under the same contention
# Its share of the 10 minutes that busy-host, decode-overhead, meta-under-decode and connections
# have together (the others take ~2.5 min): past it no round starts, and the report says so
BOUND_S = 360.0
META_P99_MS = 5.0


class Hogs:
    """``n`` CPU-bound processes at the normal priority, stopped on exit; each also stops by
    itself once this process is gone, so that a bench that dies leaves nothing spinning."""

    def __init__(self, n: int):
        # the parent's pid is given, not read at start: one started just as the bench died
        # would otherwise take its new parent for the bench
        self.procs = [subprocess.Popen([sys.executable, "-c", HOG.format(parent=os.getpid())]) for _ in range(n)]

    def __enter__(self) -> "Hogs":
        return self

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(10)


def _variants(ctx: BenchContext) -> dict[str, list[str]]:
    """Variant → extra server flags. The default is the one with a budget."""
    if ctx.quick:
        return {"default": []}
    return {"default": [], "fixed-threads": ["--fixed-threads"], "loop-normal": ["--loop-priority", "normal"]}


async def _server_round(ctx: BenchContext, flags: list[str], seconds: float) -> dict:
    args = ["--model", ctx.models.busy, "--slots", "2", "--ctx", str(CTX), "--threads", str(ctx.threads), *flags]
    with HydraServer(args, label=f"server {' '.join(flags) or '(defaults)'}") as srv:
        await pin_decode(srv.host, srv.port, 0, 16, messages_for(0))  # warm-up
        t0 = now()
        decoding = asyncio.create_task(pin_decode(srv.host, srv.port, 0, CTX - 256, messages_for(0), seconds=seconds))
        # the poller outlasts any prefill: only its polls sent while tokens flowed count
        polls = await remote_poller(srv.host, srv.port, POLL_INTERVAL, seconds + 6)
        run = (await decoding).check(CTX - 256)
    lat = [ms for t, ms, st in polls if run.times[0] <= t < run.times[-1] and st == 0]
    return {"decode_rate": run.decode_rate(), "tokens": run.tokens, "meta_ms": summarize(lat),
            "meta_failed": sum(1 for t, _ms, st in polls if run.times[0] <= t < run.times[-1] and st != 0),
            "meta_samples": [round(x, 4) for x in lat], "tokens_per_s": rate_timeline(run.times, t0)}


async def run(ctx: BenchContext) -> Result:
    res = Result(NAME)
    k = ctx.threads
    seconds = ctx.pick(4.0, 1.0)
    variants = _variants(ctx)
    order = interleaved(ctx.reps, ["bare", *variants])
    bare_params = {"model": ctx.models.busy, "n_ctx": CTX * 2, "n_seq_max": 2, "n_batch": 512, "n_threads": k,
                   "messages": messages_for(0), "n_predict": CTX - 256, "warmup": 16, "max_seconds": seconds}
    res.config = {"model": ctx.models.busy, "hogs": k, "threads": k, "seconds": seconds, "reps": ctx.reps,
                  "variants": {v: f or ["(defaults)"] for v, f in variants.items()},
                  "bare_loop": "nice 0, same threads, context and slots", "poll_interval_ms": POLL_INTERVAL * 1000,
                  "bound_s": BOUND_S}
    runs: list[dict] = []
    t_start = now()
    with Hogs(k) as hogs:
        for rep, v in order:
            if now() - t_start > BOUND_S:
                res.notes.append(f"stopped after {len(runs)} of {len(order)} rounds: past the scenario's bound of "
                                 f"{BOUND_S:.0f} s (a slow host); the figures are those rounds'")
                break
            if v == "bare":
                out = await run_worker("bare-decode", bare_params, timeout=seconds * 10 + 120)
                runs.append({"variant": v, "rep": rep, "decode_rate": out["decode_rate"], "tokens": out["tokens"]})
            else:
                runs.append({"variant": v, "rep": rep, **await _server_round(ctx, variants[v], seconds)})
            runs[-1]["hogs_alive"] = hogs.alive()  # the round ran under contention to its end
    if not all(r["hogs_alive"] for r in runs):
        res.notes.append("a CPU-bound process had stopped before the end of some rounds (samples.runs[].hogs_alive "
                         "false): those rounds were not measured under contention")
    res.samples = {"runs": runs}
    rates = {v: spread(r["decode_rate"] for r in runs if r["variant"] == v) for v in ["bare", *variants]}
    meta = {v: summarize([x for r in runs if r["variant"] == v for x in r["meta_samples"]]) for v in variants}
    meta_p99 = {v: spread(r["meta_ms"].get("p99") for r in runs if r["variant"] == v) for v in variants}
    res.summary = {"decode_tok_s": rates, "meta_ms": meta, "meta_p99_per_round": meta_p99}
    bare = rates["bare"]["median"]
    for v, flags in variants.items():
        label = "server defaults" if v == "default" else " ".join(flags)
        budgeted = v == "default"
        res.rows.append(Row(f"decode tok/s with {k} CPU-bound processes beside it ({label})", rates[v]["median"],
                            "tok/s", bare, "bare loop, nice 0, same contention",
                            f"≥ {DECODE_GOAL:.0%} of bare" if budgeted else "",
                            limit=DECODE_GOAL if budgeted and bare else None, on="ratio").with_spread(rates[v]))
        p99 = meta[v].get("p99")
        failed = sum(r["meta_failed"] for r in runs if r["variant"] == v)
        res.rows.append(Row(f"STATE_META p99 while decoding, {k} CPU-bound processes beside it ({label})", p99,
                            "ms", None, "", f"p99 < {META_P99_MS:g} ms" if budgeted else "",
                            note=f"max {meta[v].get('max')} ms, {failed} failed",
                            limit=META_P99_MS if budgeted and failed == 0 else None, kind="max",
                            ok=False if budgeted and failed else None).with_spread(meta_p99[v]))
    q = ratio(rates["default"]["median"], bare)
    if q is not None:
        res.notes.append(f"server decode at {q:.2f}× the bare loop under {k} CPU-bound processes")
    return res

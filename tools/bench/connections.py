"""connections: 1,000 idle connections held open plus 100 concurrent STATE_META pollers.

The idle connections each send one INFO (as a client that connected and then waits does;
a connection that sends nothing at all is closed by ``--first-bytes-timeout``) and are
then held. 100 pollers, each on its own connection, ask STATE_META every 20 ms; they run in
four client processes (``workers pollers``) so that the client's own event loop does not
queue them. At the end every idle connection must still answer an INFO: one that does not
was dropped.
Baseline: one poller alone against the same server, interleaved with the loaded rounds.

Then the cost of one request: the server's CPU per STATE_META (µs), from strictly sequential
requests on one connection, next to a minimal uvloop echo server's per request of the same
size in the same run (the floor: an event loop, a read and a write), interleaved.
"""
from __future__ import annotations

import asyncio
import time

from codec.enums import Op, Status
from hydra_rpc.client import HydraClient

from codec.framing import encode_request

from .common import BenchContext, Result, Row, interleaved, spread, summarize
from .procs import HydraServer, RawPeer, run_worker
from .request_cpu import cpu_per_request

NAME = "connections"
N_IDLE = 1000
N_POLLERS = 100
POLL_INTERVAL = 0.02
CLIENT_PROCESSES = 4
PROCESS_START_S = 1.5  # time for the poller processes to start before they poll together
BATCH = 100  # connections opened concurrently


async def _one_info(c: HydraClient) -> bool:
    try:
        r = await c.request(Op.INFO, timeout=30)
        return r.status == Status.OK
    except (OSError, asyncio.IncompleteReadError, TimeoutError):
        return False


async def open_idle(host: str, port: int, n: int) -> tuple[list[HydraClient], int]:
    """``n`` connections that each completed one INFO; returns them and how many failed."""
    async def one() -> HydraClient | None:
        try:
            c = await HydraClient.connect(host, port, timeout=30)
        except (OSError, TimeoutError):
            return None
        if await _one_info(c):
            return c
        await c.close()
        return None

    held, failed = [], 0
    for i in range(0, n, BATCH):
        for c in await asyncio.gather(*(one() for _ in range(min(BATCH, n - i)))):
            if c is None:
                failed += 1
            else:
                held.append(c)
    return held, failed


async def check_and_close(held: list[HydraClient]) -> int:
    """INFO on every held connection, then close it; returns how many no longer answered."""
    dropped = 0
    for i in range(0, len(held), BATCH):
        batch = held[i:i + BATCH]
        dropped += sum(1 for ok in await asyncio.gather(*(_one_info(c) for c in batch)) if not ok)
        await asyncio.gather(*(c.close() for c in batch))
    return dropped


async def poll_round(host: str, port: int, n: int, seconds: float) -> dict:
    """``n`` pollers for ``seconds``, spread over up to CLIENT_PROCESSES worker processes.

    One Python client process cannot issue ~4,400 requests/s without queueing them in its own
    event loop (measured on the 2-core machine: p50 2.2 ms with one process, 0.6 ms with
    four), which would measure the harness, not the server. The first polls of all pollers
    are spread evenly over one interval: started together they would stay in lock-step.
    """
    procs = max(1, min(CLIENT_PROCESSES, n))
    share = [n // procs + (1 if j < n % procs else 0) for j in range(procs)]
    index0 = [sum(share[:j]) for j in range(procs)]
    start_at = time.time() + PROCESS_START_S  # wall clock: the one clock all processes share
    outs = await asyncio.gather(*(run_worker("pollers", {
        "host": host, "port": port, "n": share[j], "index0": index0[j], "of": n, "slots": 4,
        "interval": POLL_INTERVAL, "seconds": seconds, "start_at": start_at}, timeout=seconds + 120)
        for j in range(procs)))
    return {"latencies_ms": [x for o in outs for x in o["latencies_ms"]], "errors": sum(o["errors"] for o in outs),
            "client_cpu_pct": round(100 * sum(o["cpu_s"] for o in outs) / seconds, 1),
            "client_processes": procs}


def _server_cpu_pct(srv: HydraServer, before: float | None, seconds: float) -> float | None:
    """CPU the server used since ``before`` (its cpu_seconds then), in % of one core over the
    ``seconds`` of polling (it idles while the poller processes start)."""
    after = srv.cpu_seconds()
    return None if before is None or after is None else round(100 * (after - before) / seconds, 1)


async def run(ctx: BenchContext) -> Result:
    res = Result(NAME)
    seconds = ctx.pick(5.0, 1.5)
    res.config = {"model": ctx.models.main, "idle_connections": N_IDLE, "pollers": N_POLLERS,
                  "poll_interval_ms": POLL_INTERVAL * 1000, "seconds": seconds, "reps": ctx.reps,
                  "client_processes": CLIENT_PROCESSES}
    rounds = []
    with HydraServer(["--model", ctx.models.main, "--slots", "4", "--threads", str(ctx.threads),
                      "--max-connections", str(2 * (N_IDLE + N_POLLERS))]) as srv:
        await poll_round(srv.host, srv.port, 1, 0.3)  # warm-up
        for rep, kind in interleaved(ctx.reps, ["baseline", "loaded"]):
            if kind == "baseline":
                rounds.append({"rep": rep, "kind": kind, **await poll_round(srv.host, srv.port, 1, seconds)})
                continue
            held, refused = await open_idle(srv.host, srv.port, N_IDLE)
            cpu0 = srv.cpu_seconds()
            polled = await poll_round(srv.host, srv.port, N_POLLERS, seconds)
            server_cpu = _server_cpu_pct(srv, cpu0, seconds)
            dropped = await check_and_close(held)
            rounds.append({"rep": rep, "kind": kind, **polled, "server_cpu_pct": server_cpu, "idle_open": len(held),
                           "idle_refused": refused, "idle_dropped": dropped})
        per_request = await _cpu_per_request(ctx, srv)
    out = []
    for r in rounds:
        out.append(r | {"answered": len(r["latencies_ms"]), "latency_ms": summarize(r["latencies_ms"])})
    res.samples = {"rounds": out}
    base = [x for x in out if x["kind"] == "baseline"]
    loaded = [x for x in out if x["kind"] == "loaded"]
    pooled = summarize([v for x in loaded for v in x["latencies_ms"]])
    pooled_base = summarize([v for x in base for v in x["latencies_ms"]])
    drops = sum(x["idle_dropped"] + x["idle_refused"] for x in loaded)
    errors = sum(x["errors"] for x in loaded)
    res.summary = {"loaded_ms": pooled, "baseline_ms": pooled_base,
                   "loaded_p99_per_round": spread(x["latency_ms"].get("p99") for x in loaded),
                   "answered": sum(x["answered"] for x in loaded), "errors": errors, "idle_drops": drops,
                   "req_per_s": round(sum(x["answered"] for x in loaded) / (seconds * len(loaded)), 1)}
    res.summary["cpu_us_per_request"] = {k: spread(x[k] for x in per_request) for k in ("server", "echo")}
    res.samples["cpu_us_per_request"] = per_request
    p99 = pooled.get("p99")
    res.rows.append(Row(f"STATE_META p99, {N_POLLERS} pollers + {N_IDLE:,} idle connections", p99, "ms",
                        pooled_base.get("p99"), "1 poller, no idle connections", "p99 < 5 ms, no drops",
                        None if p99 is None or (drops == 0 and errors == 0) else False,
                        f"{res.summary['answered']} answered ({res.summary['req_per_s']}/s), {errors} errors, "
                        f"{drops} idle connections dropped or refused; CPU: {CLIENT_PROCESSES} client processes "
                        f"{spread(x['client_cpu_pct'] for x in loaded)['median']} %, server "
                        f"{spread(x['server_cpu_pct'] for x in loaded)['median']} % of a core",
                        limit=5.0 if drops == 0 and errors == 0 else None, kind="max"
                        ).with_spread(res.summary["loaded_p99_per_round"]))
    cpu = res.summary["cpu_us_per_request"]
    res.rows.append(Row("server CPU per STATE_META request (sequential, one connection)", cpu["server"]["median"],
                        "µs", cpu["echo"]["median"], "minimal uvloop echo server: the floor",
                        note=f"{ctx.pick(CPU_REQUESTS, CPU_REQUESTS // 10)} requests per repetition"
                        ).with_spread(cpu["server"]))
    return res


CPU_REQUESTS = 20000


async def _cpu_per_request(ctx: BenchContext, srv: HydraServer) -> list[dict]:
    """Server µs per STATE_META and echo-server µs per request of the same bytes, interleaved."""
    request = encode_request(Op.STATE_META, b"0")
    n = ctx.pick(CPU_REQUESTS, CPU_REQUESTS // 10)
    out = []
    echo = RawPeer(mode="echo-server")
    try:
        for rep in range(ctx.reps):
            server = await asyncio.to_thread(cpu_per_request, srv.host, srv.port, srv, request, n)
            floor = await asyncio.to_thread(cpu_per_request, echo.host, echo.port, echo, request, n, True)
            out.append({"rep": rep, "server": server, "echo": floor})
    finally:
        echo.stop()
    return out

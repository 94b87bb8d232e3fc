"""reload-soak: does a server's memory stay flat across many T3 reloads?

One server (``--threads 1``, 2 slots) alternates between two models with ``CONFIGURE
{"model_path": …}`` — the tiny set: ``tiny`` and the KV-heavy generated model; a real model: the
file and an alias link to it, so every reload is a full T3 load of another path — while a
requester keeps short E1 DECODEs going on slot 1 (the reload waits for them, as under load).
After every swap the server's RSS (``/proc/PID/status`` ``VmRSS``) is sampled: the curve is in
the samples (``curve``: reload number, RSS MiB, load ms, seconds). The two models differ in size,
so the RSS alternates with them: the row compares the peak of the last 10 reloads with the peak
of reloads 11–20 (the budget: within 1.1×, i.e. what the first reloads allocate once — arenas,
caches — may stay, a per-reload growth may not), and notes the growth per reload after the 20th
(least squares over the peaks of each pair of reloads).

Part of ``hydra-rpc bench`` (``reload-soak``); also runs alone:
``.venv/bin/python -m tools.bench.reload_soak [--quick] [--model tiny] [--out DIR]``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path

from codec import payloads as P
from codec.enums import Op, Status
from hydra_rpc.client import HydraClient

from .common import BenchContext, BenchError, Result, Row, now, summarize
from .procs import HydraServer
from .traffic import request_ok

NAME = "reload-soak"
RELOADS, RELOADS_QUICK = 200, 24
REFERENCE, REFERENCE_QUICK = 20, 8  # the RSS the end is compared with: after this many reloads
WINDOW, WINDOW_QUICK = 10, 4  # peaks over this many reloads (both models)
BUDGET = 1.1
POLL_S = 0.02
RELOAD_TIMEOUT_S = 300.0


def rss_mib(pid: int) -> float:
    """The process's resident set (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise BenchError(f"no VmRSS for process {pid}")


async def _requester(host: str, port: int, stop: asyncio.Event) -> dict[str, int]:
    """Short E1 DECODEs on slot 1 until ``stop``: how they were answered."""
    counts: dict[str, int] = {}
    payload = P.encode_e1_decode(4, [5, 6, 7])  # token ids valid in every model's vocabulary
    c: HydraClient | None = None
    try:
        while not stop.is_set():
            try:
                if c is None:
                    c = await HydraClient.connect(host, port)
                r = await c.request(Op.DECODE, "1", payload, timeout=120)
                key = Status(r.status).name
            except (OSError, asyncio.TimeoutError, ConnectionError):
                key = "failed"
                if c is not None:
                    with contextlib.suppress(Exception):
                        await c.close()
                c = None
                await asyncio.sleep(0.05)
            counts[key] = counts.get(key, 0) + 1
            await asyncio.sleep(0.01)
    finally:
        if c is not None:
            with contextlib.suppress(Exception):
                await c.close()
    return counts


async def _reload(host: str, port: int, target: str) -> dict:
    """One T3 reload to ``target``; returns INFO's ``reload`` once the new model serves."""
    gen = (await request_ok(host, port, Op.INFO))["config_generation"]
    meta = await request_ok(host, port, Op.CONFIGURE, "", json.dumps({"model_path": target}).encode())
    if meta.get("reload") is None and not meta.get("deferred_keys"):
        raise BenchError(f"CONFIGURE model_path did not start a reload: {meta}")
    t0 = now()
    while now() - t0 < RELOAD_TIMEOUT_S:
        info = await request_ok(host, port, Op.INFO)
        reload = info.get("reload") or {}
        if reload.get("state") == "failed":
            raise BenchError(f"reload to {target} failed: {reload.get('error')}")
        if info["config_generation"] > gen and reload.get("state") not in ("loading", "draining"):
            return reload
        await asyncio.sleep(POLL_S)
    raise BenchError(f"reload to {target} did not finish within {RELOAD_TIMEOUT_S} s")


async def run(ctx: BenchContext) -> Result:
    res = Result(NAME)
    n, ref = ctx.pick(RELOADS, RELOADS_QUICK), ctx.pick(REFERENCE, REFERENCE_QUICK)
    models = [ctx.models.main, ctx.models.reload_target]
    res.config = {"models": models, "reloads": n, "reference_after": ref, "threads": 1, "parallel": 2}
    curve: list[list[float]] = []
    with HydraServer(["--model", models[0], "--threads", "1", "--parallel", "2"], label="server") as srv:
        await request_ok(srv.host, srv.port, Op.INFO)
        start = rss_mib(srv.pid)
        stop = asyncio.Event()
        load = asyncio.create_task(_requester(srv.host, srv.port, stop))
        t0 = now()
        try:
            for i in range(1, n + 1):
                reload = await _reload(srv.host, srv.port, models[i % 2])
                curve.append([i, round(rss_mib(srv.pid), 2), reload.get("load_ms"), round(now() - t0, 2)])
        finally:
            stop.set()
            answered = await load
    # The two models differ in size, so RSS alternates with them: compare peaks over windows of
    # reloads (both models in each), and the growth per reload of the pairs' peaks.
    w = ctx.pick(WINDOW, WINDOW_QUICK)
    at_ref = _peak(curve, ref - w, ref)
    at_end = _peak(curve, n - w, n)
    pairs = [(int(curve[k + 1][0]), max(curve[k][1], curve[k + 1][1])) for k in range(0, len(curve) - 1, 2)]
    slope = _slope([(i, rss) for i, rss in pairs if i >= ref])
    growth = round(slope * 1024, 1) if slope is not None else None
    res.samples = {"curve": curve, "curve_columns": ["reload", "rss_mib", "load_ms", "t_s"], "start_rss_mib": start,
                   "pair_peaks": pairs, "requests": answered}
    res.summary = {"rss_start_mib": round(start, 2), "window": w, "rss_peak_at_reference_mib": at_ref,
                   "rss_peak_at_end_mib": at_end, "growth_per_reload_after_reference_kib": growth,
                   "rss_by_model_mib": {m: summarize(c[1] for c in curve if models[int(c[0]) % 2] == m) for m in models},
                   "load_ms": summarize(ms for _i, _rss, ms, _t in curve if ms is not None), "requests": answered}
    res.rows.append(Row(f"RSS after {n} T3 reloads under load (peak of the last {w})", at_end, "MiB", at_ref,
                        f"peak of reloads {ref - w + 1}–{ref}", f"≤ {BUDGET}× the RSS after {ref}", limit=BUDGET,
                        on="ratio", kind="max",
                        note=f"start {start:.0f} MiB; {growth} KiB per reload after {ref} (pair peaks, least squares)"))
    return res


def _peak(curve: list[list], after: int, upto: int) -> float | None:
    """The highest RSS sampled after reloads ``after`` + 1 … ``upto``."""
    values = [c[1] for c in curve if after < c[0] <= upto]
    return max(values) if values else None


def _slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares MiB per reload."""
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else None


def main(argv: list[str] | None = None) -> int:
    from .common import usable_cpus
    from .models import model_set

    p = argparse.ArgumentParser(prog="python -m tools.bench.reload_soak", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{RELOADS_QUICK} reloads instead of {RELOADS}")
    p.add_argument("--model", default="tiny", help="tiny (default) or a GGUF path / model name")
    p.add_argument("--out", default="bench-results", help="directory for reload-soak.json")
    args = p.parse_args(argv)
    ctx = BenchContext(quick=args.quick, models=model_set(args.model), reps=1, threads=usable_cpus())
    res = asyncio.run(run(ctx))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = res.write(out)
    for r in res.rows:
        verdict = "ok" if r.ok else ("over budget" if r.ok is False else "")
        print(f"{r.metric}: {r.value} {r.unit} (baseline {r.baseline} {r.baseline_label}, ratio "
              f"{r.ratio if r.ratio is None else round(r.ratio, 3)}) {verdict} — {r.note}")
    print(f"curve and summary: {path}", file=sys.stderr)
    return 0 if all(r.ok is not False for r in res.rows) else 1


if __name__ == "__main__":
    sys.exit(main())

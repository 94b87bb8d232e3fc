"""reload-stall: what clients see while a T3 CONFIGURE reloads the model.

One slot streams a long PIN decode (continuing a long prefilled context, so its rate is
nearly flat); a poller sends INFO and STATE_META (alternately, every
few ms) on its own connection; a requester asks for short E1 DECODEs on another slot and
notes which ``config_generation`` served each (or whether it got BUSY). After a quiet
stretch the harness sends ``CONFIGURE {"model_path": <another model>}``. The decode keeps
going until the new model is ready (plus a short hold), then its client closes it — the
swap waits for in-flight work — and everything continues on the new generation.

Variants, interleaved: the two reload policies (``serve-old``, ``reject``) and, with
``--blocking-baseline``, the C++ behaviour emulated by :mod:`tools.bench.blocking_server`
(in-place reload: wait for idle, free the old model, load on the event-loop thread).
These servers run ``--threads 1`` so the loader and the decoder do not fight over the two
cores. Baseline of every figure: the same run before the CONFIGURE.

Then the same reload with the server's **default flags** (:mod:`tools.bench.reload_defaults`):
decode and chat latency during the load against before it, and the load time against the
same load on an idle server.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

from codec import payloads as P
from codec.enums import Op, Status
from hydra_rpc.client import HydraClient

from . import reload_defaults
from .common import BenchContext, BenchError, Result, Row, interleaved, now, rounded, spread, summarize
from .procs import HydraServer
from .traffic import (PinRun, Poller, latencies, messages_for, pin_decode, poll_columns, rate_timeline, request_ok,
                      tokens_between)

NAME = "reload-stall"
POLL_INTERVAL = 0.003
REQUEST_INTERVAL = 0.05
HOLD = 0.3  # the decode runs on this long after the new model is ready, then is closed
POST = 0.5  # observation after the swap
CTX = 8192
PREFILL_TOKENS = 5000  # tiny-small: ~400 tok/s from there, ~1,000 tokens per run fit the context
PREFILL_TOKENS_REAL = 512  # a real model prefills far slower; its decode step is dominated by weights
MIN_LOAD_WINDOW = 0.05  # a load shorter than this gives no meaningful tokens/s
BEFORE_WINDOW = 0.5


async def _requester(host: str, port: int, stop: asyncio.Event, t0: float) -> list[list]:
    """Short E1 DECODEs on slot 1: (t, ms, status, config_generation) of each."""
    out: list[list] = []
    payload = P.encode_e1_decode(4, [5, 6, 7])  # token ids valid in every model's vocabulary
    c: HydraClient | None = None
    try:
        while not stop.is_set():
            t = now()
            try:
                if c is None:
                    c = await HydraClient.connect(host, port)
                r = await c.request(Op.DECODE, "1", payload, timeout=60)
                out.append([round(t - t0, 5), round((now() - t) * 1000, 3), r.status,
                            (r.meta or {}).get("config_generation")])
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                out.append([round(t - t0, 5), round((now() - t) * 1000, 3), -1, None])
                c = None
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(stop.wait(), REQUEST_INTERVAL)
    finally:
        if c is not None:
            await c.close()
    return out


async def _watch(poller: Poller, since: float, pred, timeout: float) -> float:
    """Receive time of the first poll sent after ``since`` that satisfies ``pred``."""
    deadline = now() + timeout
    seen = 0
    while now() < deadline:
        polls = poller.polls
        for p in polls[seen:]:
            if p.t >= since and pred(p):
                return p.t + p.ms / 1000
        seen = len(polls)
        await asyncio.sleep(0.002)
    raise BenchError(f"reload did not progress within {timeout:.0f}s")


def _server_args(ctx: BenchContext, variant: str) -> tuple[list[str], str]:
    args = ["--model", ctx.models.busy, "--slots", "2", "--ctx", str(CTX), "--threads", "1"]
    if variant == "reject":
        return args + ["--reload-policy", "reject"], "hydra_rpc.cli serve"
    if variant == "blocking":
        return args + ["--reload-mode", "inplace"], "tools.bench.blocking_server"
    return args, "hydra_rpc.cli serve"


@dataclass
class _Reload:
    """What one run saw while the model reloaded: harness-clock times and the clients' records."""

    t0: float  # the clients start
    t_cfg: float = 0.0  # CONFIGURE sent
    t_ready: float = 0.0  # the new model is built
    t_cancel: float = 0.0  # the decode's client closes it
    t_swap: float = 0.0  # the new generation serves
    target: int = 0  # its config_generation
    run: PinRun | None = None  # the decode's pieces
    polls: list = field(default_factory=list)
    requests: list = field(default_factory=list)


async def one_run(ctx: BenchContext, variant: str, before_s: float) -> dict:
    args, module = _server_args(ctx, variant)
    with HydraServer(args, module=module, label=f"server ({variant})") as srv:
        gen0, n_prefill = await _prefill_long_context(ctx, srv)
        rl = await _reload_under_load(ctx, srv, n_prefill, before_s, gen0)
        info = await request_ok(srv.host, srv.port, Op.INFO)
    reload = info.get("reload") or {}
    if reload.get("state") != "swapped" or info.get("config_generation", 0) < rl.target:
        raise BenchError(f"{variant}: reload did not complete: {reload}")
    return _run_figures(variant, gen0, rl, reload)


async def _prefill_long_context(ctx: BenchContext, srv: HydraServer) -> tuple[int, int]:
    """Warm up, then prefill slot 0 with a long random context: (config_generation, tokens prefilled)."""
    await pin_decode(srv.host, srv.port, 0, 32, messages_for(0))  # warm-up
    info = await request_ok(srv.host, srv.port, Op.INFO)
    gen0 = info["config_generation"]
    # A decode's rate falls as its context grows (attention). Starting it from a long
    # prefilled context keeps that drift to a few % across the window compared, so a
    # drop during the load is the load's doing.
    n_prefill = ctx.pick(PREFILL_TOKENS, PREFILL_TOKENS // 2) if ctx.models.tiny else PREFILL_TOKENS_REAL
    rnd = random.Random(11)
    prompt = [rnd.randrange(3, info.get("n_vocab") or 256) for _ in range(n_prefill)]
    await request_ok(srv.host, srv.port, Op.PREFILL, "0", P.encode_e1_tokens(prompt), timeout=600)
    return gen0, n_prefill


async def _reload_under_load(ctx: BenchContext, srv: HydraServer, n_prefill: int, before_s: float,
                             gen0: int) -> _Reload:
    """Decode, poll and request; after ``before_s`` the CONFIGURE; the decode is closed once the
    new model is ready (plus HOLD), and the others go on until POST after the swap."""
    stop_all, stop_decode = asyncio.Event(), asyncio.Event()
    rl = _Reload(t0=now())
    poller = Poller(srv.host, srv.port, [(Op.INFO, ""), (Op.STATE_META, "0")], POLL_INTERVAL, timeout=30)
    polling = asyncio.create_task(poller.run(stop_all))
    requesting = asyncio.create_task(_requester(srv.host, srv.port, stop_all, rl.t0))
    n_decode = CTX - n_prefill - 64
    decoding = asyncio.create_task(pin_decode(srv.host, srv.port, 0, n_decode, None, stop=stop_decode))
    try:
        await asyncio.sleep(before_s)
        rl.t_cfg = t_cfg = now()
        meta = await request_ok(srv.host, srv.port, Op.CONFIGURE, "", P.dumps_compact(
            {"model_path": ctx.models.reload_target}))
        rl.target = target = meta.get("config_generation", gen0 + 1)
        # "ready": the new model is built (draining) or already live; a poll answered
        # before the CONFIGURE was processed still says "idle" and does not count
        rl.t_ready = await _watch(poller, t_cfg, lambda p: p.op == "INFO" and p.status == Status.OK and (
            p.reload_state in ("draining", "swapped") or (p.generation or 0) >= target), 120)
        await asyncio.sleep(max(0.0, rl.t_ready + HOLD - now()))
        rl.t_cancel = now()
        stop_decode.set()
        rl.run = (await decoding).check(n_decode)
        rl.t_swap = await _watch(poller, t_cfg, lambda p: p.status == Status.OK and p.op == "INFO"
                                 and (p.generation or 0) >= target, 120)
        await asyncio.sleep(POST)
    finally:
        stop_all.set()
        stop_decode.set()
        rl.polls = await polling
        rl.requests = await requesting
        if not decoding.done():
            decoding.cancel()
            with contextlib.suppress(BaseException):
                await decoding
    return rl


def _run_figures(variant: str, gen0: int, rl: _Reload, reload: dict) -> dict:
    """One run's sample: rates and poll latencies before and during the load, and its timelines."""
    t0, t_cfg, t_swap, run, polls = rl.t0, rl.t_cfg, rl.t_swap, rl.run, rl.polls
    load_s = (reload.get("load_ms") or 0) / 1000
    # the load overlaps the decode only in the shadow variants; it starts at the CONFIGURE.
    # "before" is the half second just before it
    w = min(BEFORE_WINDOW, t_cfg - (run.times[0] if run.times else t_cfg))
    before_rate = tokens_between(run.times, t_cfg - w, t_cfg) / w if w > 0 else None
    during_rate = (tokens_between(run.times, t_cfg, t_cfg + load_s) / load_s
                   if variant != "blocking" and load_s >= MIN_LOAD_WINDOW else None)
    lat_before = latencies(polls, t0 + 0.2, t_cfg)
    lat_during = latencies(polls, t_cfg, t_swap)
    failed_during = sum(1 for p in polls if t_cfg <= p.t < t_swap and p.status != Status.OK)
    return {
        "variant": variant, "generation_before": gen0, "generation_after": rl.target, "reload": reload,
        "marks": {"configure": 0.0, "ready": round(rl.t_ready - t_cfg, 5),
                  "decode_closed": round(rl.t_cancel - t_cfg, 5), "swapped": round(t_swap - t_cfg, 5)},
        "time_to_swap_s": t_swap - t_cfg, "load_ms": reload.get("load_ms"), "swap_ms": reload.get("swap_ms"),
        "poll_before_ms": summarize(lat_before), "poll_during_ms": summarize(lat_during),
        "polls_failed_during": failed_during, "tok_s_before": before_rate, "tok_s_during_load": during_rate,
        "requests": {"columns": ["t", "ms", "status", "generation"],
                     "rows": [[round(r[0] - (t_cfg - t0), 5), *r[1:]] for r in rl.requests]},
        "polls": poll_columns(polls, t_cfg),
        "piece_times": rounded([t - t_cfg for t in run.times], 5),
        "tokens_per_s": rate_timeline(run.times, t_cfg),
    }


async def run(ctx: BenchContext) -> Result:
    res = Result(NAME)
    variants = ["serve-old", "reject"] + (["blocking"] if ctx.blocking_baseline else [])
    before_s = ctx.pick(1.5, 0.6)
    res.config = {"model": ctx.models.busy, "reload_target": ctx.models.reload_target, "threads": 1,
                  "prefill_tokens": ctx.pick(PREFILL_TOKENS, PREFILL_TOKENS // 2) if ctx.models.tiny
                  else PREFILL_TOKENS_REAL,
                  "variants": variants, "reps": ctx.reps, "poll_interval_ms": POLL_INTERVAL * 1000,
                  "hold_after_ready_s": HOLD, "before_s": before_s}
    runs = [await one_run(ctx, v, before_s) for _, v in interleaved(ctx.reps, variants)]
    defaults, default_rows, default_summary = await reload_defaults.measure(ctx)
    res.samples = {"runs": runs, "defaults": defaults}
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        s = {"poll_p99_before_ms": spread(r["poll_before_ms"].get("p99") for r in rs),
             "poll_p99_during_ms": spread(r["poll_during_ms"].get("p99") for r in rs),
             "poll_max_during_ms": spread(r["poll_during_ms"].get("max") for r in rs),
             "polls_failed_during": sum(r["polls_failed_during"] for r in rs),
             "tok_s_before": spread(r["tok_s_before"] for r in rs),
             "tok_s_during_load": spread(r["tok_s_during_load"] for r in rs),
             "load_ms": spread(r["load_ms"] for r in rs), "time_to_swap_s": spread(r["time_to_swap_s"] for r in rs),
             "requests_by_status_and_generation": _served(rs)}
        res.summary[v] = s
        p99, base = s["poll_p99_during_ms"]["median"], s["poll_p99_before_ms"]["median"]
        label = "blocking emulation of the C++" if v == "blocking" else f"--reload-policy {v}"
        if v == "blocking":
            res.rows.append(Row(f"INFO/META max stall during a T3 reload ({label})", s["poll_max_during_ms"]["median"],
                                "ms", base, "p99 before the reload", "", None,
                                f"p99 {p99}; load {s['load_ms']['median']} ms"))
            continue
        res.rows.append(Row(f"INFO/META p99 during a T3 reload ({label})", p99, "ms", base, "before the reload",
                            "p99 < 10 ms", note=f"max {s['poll_max_during_ms']['median']} ms, "
                            f"{s['polls_failed_during']} failed; swap after {s['time_to_swap_s']['median']:.2f} s",
                            limit=10.0 if p99 is not None else None, kind="max").with_spread(s["poll_p99_during_ms"]))
        during, before = s["tok_s_during_load"]["median"], s["tok_s_before"]["median"]
        res.rows.append(Row(f"old-config decode tok/s during the load ({label}, --threads 1)", during, "tok/s", before,
                            "before the reload", "≥ 80 % (n_threads 1)",
                            note=f"load {s['load_ms']['median']} ms" + ("" if during is not None else
                                                                        " — too short to measure a rate"),
                            limit=0.8 if during is not None and before else None, on="ratio"
                            ).with_spread(s["tok_s_during_load"]))
    res.summary["defaults"] = default_summary
    res.rows += default_rows
    return res


def _served(runs: list[dict]) -> dict[str, int]:
    """How the requester's E1 DECODEs were answered: "OK g1", "OK g2", "BUSY", "failed"."""
    out: dict[str, int] = {}
    for r in runs:
        for _t, _ms, status, gen in r["requests"]["rows"]:
            key = f"OK g{gen}" if status == Status.OK else ("failed" if status < 0 else Status(status).name)
            out[key] = out.get(key, 0) + 1
    return out

"""reload-stall with default flags: what a T3 reload costs the clients of a server started
as users start it (every core for compute, the default priorities, ``serve-old``).

One server per repetition, four phases on it, each reload to another file name of the same
model (a real T3 reload, the same work each time):

1. an idle reload: the load time with nothing else running (the baseline of 3 and 4);
2. three chat completions (``max_tokens`` 16, greedy, the same prompt) on the idle server:
   the baseline chat latency;
3. a reload while one slot streams a long PIN decode: its tok/s in the load window against
   the second before the CONFIGURE, and the load time;
4. a reload while chats are fired back to back for as long as INFO says ``loading``: their
   latency, and which ``config_generation`` served them (the old one, under ``serve-old``).

The model loads in about a second: Gemma 3 270M with ``--model gemma-270m``, the generated
``tiny-large`` (a 524,288-token vocabulary and q4_0 weights) in tiny mode.
"""
from __future__ import annotations

import asyncio
from typing import Any

from codec import payloads as P
from codec.enums import Op

from .common import BenchContext, BenchError, Row, now, spread
from .models import load_heavy
from .procs import HydraServer
from .traffic import messages_for, pin_decode, rate_timeline, request_ok, tokens_between, wait_generation

CTX = 4096
CHATS_IDLE = 3
CHAT = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 16, "temperature": 0}
BEFORE_S = 1.0
DECODE_GOAL, CHAT_GOAL, LOAD_GOAL = 0.75, 1.5, 1.25


async def _chat(http, url: str) -> dict[str, Any]:
    t = now()
    async with http.post(url, json=CHAT) as r:
        body = await r.json(content_type=None)
    return {"t": t, "ms": (now() - t) * 1000, "status": r.status,
            "generation": body.get("config_generation") if isinstance(body, dict) else None,
            "tokens": ((body.get("usage") or {}).get("completion_tokens") if isinstance(body, dict) else None)}


async def _reload(srv: HydraServer, path: str) -> tuple[float, int]:
    """CONFIGURE {"model_path": path}; (its send time, the generation it promises)."""
    t = now()
    meta = await request_ok(srv.host, srv.port, Op.CONFIGURE, "", P.dumps_compact({"model_path": path}))
    return t, meta["config_generation"]


async def _reload_state(srv: HydraServer) -> dict[str, Any]:
    return (await request_ok(srv.host, srv.port, Op.INFO)).get("reload") or {}


async def _finish(srv: HydraServer, generation: int) -> float:
    """Wait until ``generation`` is live; the load time INFO reports for it, in ms."""
    info = await wait_generation(srv.host, srv.port, generation)
    return float((info.get("reload") or {}).get("load_ms") or 0)


async def one_rep(ctx: BenchContext, model: str, target: str, http) -> dict[str, Any]:
    with HydraServer(["--model", model, "--slots", "2", "--ctx", str(CTX)], http=True,
                     label="server (default flags)") as srv:
        url = f"http://127.0.0.1:{srv.http_port}/v1/chat/completions"
        await pin_decode(srv.host, srv.port, 0, 16, messages_for(0))  # warm-up
        await _chat(http, url)
        paths = [target, model, target]
        # 1. idle load
        _, g = await _reload(srv, paths[0])
        load_idle = await _finish(srv, g)
        # 2. idle chats
        idle_chats = [await _chat(http, url) for _ in range(CHATS_IDLE)]
        # 3. decode through a reload
        stop = asyncio.Event()
        decoding = asyncio.create_task(pin_decode(srv.host, srv.port, 0, CTX - 256, messages_for(0), stop=stop))
        await asyncio.sleep(BEFORE_S)
        t_cfg, g = await _reload(srv, paths[1])
        while (await _reload_state(srv)).get("state") == "loading" and not decoding.done():
            await asyncio.sleep(0.01)
        stop.set()
        run = (await decoding).check(CTX - 256)
        load_decode = await _finish(srv, g)
        if run.times[-1] < t_cfg + load_decode / 1000:
            raise BenchError("the decode ended before the load did: raise the context")
        before = tokens_between(run.times, t_cfg - BEFORE_S / 2, t_cfg) / (BEFORE_S / 2)
        during = tokens_between(run.times, t_cfg, t_cfg + load_decode / 1000) / (load_decode / 1000)
        # 4. chats through a reload (the first goes out at once: the load has just begun)
        t_cfg2, g2 = await _reload(srv, paths[2])
        g_old = g2 - 1
        chats = [await _chat(http, url)]
        while (await _reload_state(srv)).get("state") == "loading":
            chats.append(await _chat(http, url))
        load_chats = await _finish(srv, g2)
    t_end = t_cfg2 + load_chats / 1000
    during_chats = [c for c in chats if c["t"] < t_end]
    return {"load_idle_ms": load_idle, "load_decode_ms": load_decode, "load_chats_ms": load_chats,
            "tok_s_before": before, "tok_s_during_load": during,
            "chat_idle_ms": [c["ms"] for c in idle_chats], "chat_during_ms": [c["ms"] for c in during_chats],
            "chats_during": [{**c, "t": round(c["t"] - t_cfg2, 4)} for c in during_chats],
            "chats_old_config": sum(1 for c in during_chats if c["status"] == 200 and c["generation"] == g_old),
            "chats_failed": sum(1 for c in during_chats if c["status"] != 200),
            "tokens_per_s": rate_timeline(run.times, t_cfg), "marks": {"load_end": round(load_decode / 1000, 4)}}


async def measure(ctx: BenchContext) -> tuple[list[dict], list[Row], dict]:
    import aiohttp

    model, target = load_heavy(ctx.models, ctx.quick)
    async with aiohttp.ClientSession() as http:
        reps = [await one_rep(ctx, model, target, http) for _ in range(ctx.reps)]
    med = lambda xs: spread(xs)["median"]  # noqa: E731
    s = {"load_idle_ms": spread(r["load_idle_ms"] for r in reps),
         "load_decode_ms": spread(r["load_decode_ms"] for r in reps),
         "load_chats_ms": spread(r["load_chats_ms"] for r in reps),
         "tok_s_before": spread(r["tok_s_before"] for r in reps),
         "tok_s_during_load": spread(r["tok_s_during_load"] for r in reps),
         "chat_idle_ms": spread(med(r["chat_idle_ms"]) for r in reps),
         "chat_during_ms": spread(med(r["chat_during_ms"]) for r in reps),
         "chats_during": sum(len(r["chat_during_ms"]) for r in reps),
         "chats_old_config": sum(r["chats_old_config"] for r in reps),
         "chats_failed": sum(r["chats_failed"] for r in reps), "model": model, "target": target}
    label = "default flags"
    rows = [
        Row(f"old-config decode tok/s during the load ({label})", s["tok_s_during_load"]["median"], "tok/s",
            s["tok_s_before"]["median"], "before the reload", f"≥ {DECODE_GOAL:.0%} of before",
            note=f"load {s['load_decode_ms']['median']:.0f} ms", limit=DECODE_GOAL, on="ratio"
            ).with_spread(s["tok_s_during_load"]),
        Row(f"chat completion latency during the load ({label}, max_tokens 16)", s["chat_during_ms"]["median"], "ms",
            s["chat_idle_ms"]["median"], "idle server", f"≤ {CHAT_GOAL:g}× idle",
            note=f"{s['chats_during']} chats during the loads, {s['chats_old_config']} served by the old config, "
                 f"{s['chats_failed']} failed", limit=CHAT_GOAL if not s["chats_failed"] else None,
            on="ratio", kind="max", ok=False if s["chats_failed"] else None).with_spread(s["chat_during_ms"]),
        Row(f"load time while a slot decodes ({label})", s["load_decode_ms"]["median"], "ms",
            s["load_idle_ms"]["median"], "the same load, idle server", f"≤ {LOAD_GOAL:g}× idle",
            limit=LOAD_GOAL, on="ratio", kind="max").with_spread(s["load_decode_ms"]),
        Row(f"load time while chats are served ({label})", s["load_chats_ms"]["median"], "ms",
            s["load_idle_ms"]["median"], "the same load, idle server").with_spread(s["load_chats_ms"]),
    ]
    return reps, rows, s

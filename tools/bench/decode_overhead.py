"""decode-overhead: tokens/s through the server vs a bare llama-cpp-python loop.

Same model, threads, context size, slots, prompt and priority (the bare loop runs at the
server's inference priority, nice 0, so both yield alike to whatever else runs on the host);
greedy. Two processes either way:
the server + this client, or the bare loop (``workers bare-decode``) + this idle harness.
Candidates: the PIN streaming DECODE (rate from first to last streamed piece, against the
bare loop's first to last sampled token) and, when the server has its HTTP side, DECODE v3
with its result fetched from ``GET /v1/decode/{id}`` (end to end, against the bare loop's
end to end). Runs are interleaved bare / PIN / v3, rotating each repetition. The server runs
``--fixed-threads`` like the bare loop: this scenario measures the per-token cost, not the
thread policy (that is busy-host's).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from codec import decode_v3 as V3
from codec.enums import Op, Status
from hydra_rpc.client import HydraClient
from tools.spawn import cpu_used

from .common import BenchContext, BenchError, Result, Row, interleaved, now, ratio, spread
from .procs import HydraServer, run_worker
from .traffic import messages_for, pin_decode

NAME = "decode-overhead"
SLOTS = 4
# How often the v3 result is polled: each poll costs CPU on both sides (taken from the
# decode on a 2-core host), and the end time is known to within this much of a ~1.5 s run.
RESULT_POLL_S = 0.02
INFERENCE_NICE = 0  # the server's inference thread priority (its default; see docs/architecture.md, 'Priorities')
DONE_STATES = ("done", "completed", "finished", "ok", "success", "complete")
COUNT_KEYS = ("tokens_generated", "tokens_predicted", "completion_tokens", "n_decoded", "n_generated")


def server_cpu_per_token(srv: HydraServer, before: dict[int, float], own_before: float, tokens: int
                         ) -> dict[str, float]:
    """Where a PIN run's CPU went, µs per streamed token: the server's event-loop thread (its
    main thread), its other threads (inference and ggml's compute threads) and this client.

    Every figure spans the whole request (prompt, stream, close), as the bare loop's spans its
    prefill and decode. On a host whose cores all compute, the loop's and the client's CPU is
    taken from the decode: it is where the server's tok/s goes below the bare loop's."""
    after, per = srv.thread_cpu(), 1e6 / max(tokens, 1)
    loop_s = after.get(srv.pid, 0.0) - before.get(srv.pid, 0.0)
    return {"loop": loop_s * per, "compute": cpu_used(before, after, skip=(srv.pid,)) * per,
            "client": (time.process_time() - own_before) * per}


def budgets(tiny: bool) -> tuple[float, float]:
    """(PIN stream, DECODE v3 end to end) as shares of the bare loop's tok/s."""
    return (0.95, 0.92) if tiny else (0.99, 0.99)


def _find_count(obj: Any) -> int | None:
    """The generated-token count in a result body, wherever the HTTP side puts it."""
    if isinstance(obj, dict):
        for k in COUNT_KEYS:
            if isinstance(obj.get(k), int) and not isinstance(obj.get(k), bool):
                return obj[k]
        for v in obj.values():
            n = _find_count(v)
            if n is not None:
                return n
    return None


async def v3_decode(srv: HydraServer, slot: int, n_predict: int, messages: list, http,
                    cap_s: float) -> dict[str, Any]:
    """DECODE v3 (no KV segment, prompt = messages array), then poll the HTTP result until done.

    After ``cap_s`` the generation is cancelled (``DELETE /v1/decode/{id}``) and the partial
    result counts: a busy host must not stretch one run into minutes.
    """
    prompt = json.dumps(messages).encode()
    gen = {"n_predict": n_predict, "sampling": {"temperature": 0}, "stop": [], "stream": False}
    payload = V3.encode_decode_v3({"generation": gen}, prompt)
    t_send = now()
    async with await HydraClient.connect(srv.host, srv.port) as c:
        r = await c.request(Op.DECODE, str(slot), payload)
    if r.status != Status.OK or not (r.meta or {}).get("valid"):
        raise BenchError(f"DECODE v3 refused: {r!r}")
    url = f"http://127.0.0.1:{srv.http_port}/v1/decode/{r.meta['decode_request_id']}"
    deadline, cancelled = t_send + cap_s, False
    while True:
        if not cancelled and now() > deadline:
            async with http.delete(url) as resp:
                cancelled = resp.status in (200, 202)
        async with http.get(url) as resp:
            body = await resp.json(content_type=None) if resp.status in (200, 202) else await resp.text()
            if resp.status == 202:
                pass
            elif resp.status == 200:
                state = str(body.get("state") or body.get("status") or "done").lower() if isinstance(body, dict) else ""
                if state in DONE_STATES or state == "cancelled":
                    t_done = now()
                    n = _find_count(body)
                    if n is None:
                        raise BenchError(f"no token count in the decode result: {str(body)[:300]}")
                    return {"tokens": n, "e2e_rate": n / (t_done - t_send)}
                if state not in ("running", "pending", "loading", "queued"):
                    raise BenchError(f"decode result in state {state!r}: {str(body)[:300]}")
            else:
                raise BenchError(f"GET {url} answered {resp.status}: {str(body)[:300]}")
        await asyncio.sleep(RESULT_POLL_S)


async def run(ctx: BenchContext) -> Result:
    res = Result(NAME)
    tiny = ctx.models.tiny
    n_max = ctx.pick(3000 if tiny else 256, 400 if tiny else 48)
    target_s = ctx.pick(1.5, 0.5)  # seconds of decoding per run aimed at
    cap_s = 4 * target_s  # and never more than this, however slow the host is today
    slot_ctx = 8192 if tiny else 4096
    msgs = messages_for(0)
    variants = ["bare", "pin"] + (["v3"] if ctx.http else [])
    if not ctx.http:
        res.notes.append("DECODE v3 + HTTP not measured: this build has no HTTP side (hydra_rpc.http.app).")
    with HydraServer(["--model", ctx.models.main, "--slots", str(SLOTS), "--ctx", str(slot_ctx),
                      "--threads", str(ctx.threads), "--fixed-threads"], http=ctx.http) as srv:
        await pin_decode(srv.host, srv.port, 0, 32, msgs)  # warm-up
        # Every run decodes the same number of tokens: as many as ~target_s takes right now
        cal = (await pin_decode(srv.host, srv.port, 0, n_max, msgs, until=now() + target_s)).check(n_max)
        n = max(32, min(n_max, int((cal.decode_rate() or 0) * target_s)))
        bare_params = {"model": ctx.models.main, "n_ctx": slot_ctx * SLOTS, "n_seq_max": SLOTS, "n_batch": 512,
                       "n_threads": ctx.threads, "messages": msgs, "n_predict": n, "warmup": 32,
                       "nice": INFERENCE_NICE, "max_seconds": cap_s}
        res.config = {"model": ctx.models.main, "n_predict": n, "n_predict_max": n_max,
                      "calibration_tok_s": cal.decode_rate(), "cap_seconds": cap_s, "slot_ctx": slot_ctx,
                      "slots": SLOTS, "threads": ctx.threads, "reps": ctx.reps, "variants": variants,
                      "bare_loop_nice": INFERENCE_NICE}
        runs = await _interleaved_runs(ctx, srv, variants, bare_params, n, msgs, cap_s)
    _summarize(res, runs, variants, tiny, bool(ctx.http))
    return res


async def _interleaved_runs(ctx: BenchContext, srv: HydraServer, variants: list[str], bare_params: dict[str, Any],
                            n: int, msgs: list, cap_s: float) -> list[dict[str, Any]]:
    """``ctx.reps`` runs of every variant (bare loop, PIN stream, DECODE v3), interleaved."""
    runs: list[dict[str, Any]] = []
    http = None
    if ctx.http:
        import aiohttp

        http = aiohttp.ClientSession()
    try:
        for rep, v in interleaved(ctx.reps, variants):
            if v == "bare":
                out = await run_worker("bare-decode", bare_params)
                runs.append({"variant": v, "rep": rep, "tokens": out["tokens"], "decode_rate": out["decode_rate"],
                             "e2e_rate": out["e2e_rate"],
                             "cpu_us_per_token": {"compute": out["compute_cpu_s"] / out["tokens"] * 1e6}})
            elif v == "pin":
                server_cpu, own_cpu = srv.thread_cpu(), time.process_time()
                r = (await pin_decode(srv.host, srv.port, 0, n, msgs, until=now() + cap_s)).check(n)
                runs.append({"variant": v, "rep": rep, "tokens": r.tokens, "decode_rate": r.decode_rate(),
                             "e2e_rate": r.e2e_rate(),
                             "cpu_us_per_token": server_cpu_per_token(srv, server_cpu, own_cpu, r.tokens)})
            else:
                out = await v3_decode(srv, 0, n, msgs, http, cap_s)
                runs.append({"variant": v, "rep": rep, **out})
    finally:
        if http is not None:
            await http.close()
    return runs


def _summarize(res: Result, runs: list[dict[str, Any]], variants: list[str], tiny: bool, http: bool) -> None:
    """The runs' spreads into ``res.summary`` and its rows: PIN and v3 tok/s against the bare loop, CPU per token."""

    def med(variant: str, key: str) -> float | None:
        return spread(r.get(key) for r in runs if r["variant"] == variant)["median"]

    def per_rep(variant: str, key: str) -> dict:
        pairs = {}
        for r in runs:
            pairs.setdefault(r["rep"], {})[r["variant"]] = r.get(key)
        return spread(ratio(p.get(variant), p.get("bare")) for p in pairs.values())

    res.samples = {"runs": runs}
    res.summary = {v: {"decode_rate": spread(r.get("decode_rate") for r in runs if r["variant"] == v),
                       "e2e_rate": spread(r["e2e_rate"] for r in runs if r["variant"] == v),
                       "tokens": spread(r["tokens"] for r in runs if r["variant"] == v)} for v in variants}
    res.summary["pin_vs_bare_per_rep"] = per_rep("pin", "decode_rate")
    pin_goal, v3_goal = budgets(tiny)
    which = "tiny model" if tiny else "real model"
    pin, bare = med("pin", "decode_rate"), med("bare", "decode_rate")
    res.rows.append(Row("PIN streaming DECODE tok/s", pin, "tok/s", bare, "bare llama-cpp-python loop",
                        f"≥ {pin_goal:.0%} of bare ({which})",
                        note=f"per-rep ratio {res.summary['pin_vs_bare_per_rep']['min']}–"
                             f"{res.summary['pin_vs_bare_per_rep']['max']}",
                        limit=pin_goal if bare else None, on="ratio").with_spread(res.summary["pin"]["decode_rate"]))
    cpu = {f"{v}_{part}": spread(r["cpu_us_per_token"].get(part) for r in runs if r["variant"] == v)
           for v, part in (("bare", "compute"), ("pin", "compute"), ("pin", "loop"), ("pin", "client"))}
    res.summary["cpu_us_per_token"] = cpu
    res.rows.append(Row("PIN DECODE CPU per token: the server's compute threads", cpu["pin_compute"]["median"],
                        "µs", cpu["bare_compute"]["median"], "the bare loop's threads",
                        note=f"besides them, the server's event loop {_us(cpu['pin_loop'])} µs "
                             f"and the client {_us(cpu['pin_client'])} µs per token, on the same cores",
                        ).with_spread(cpu["pin_compute"]))
    if http:
        v3, bare_e2e = med("v3", "e2e_rate"), med("bare", "e2e_rate")
        res.rows.append(Row("DECODE v3 + HTTP result tok/s (end to end)", v3, "tok/s", bare_e2e,
                            "bare loop, end to end", f"≥ {v3_goal:.0%} of bare ({which})",
                            limit=v3_goal if bare_e2e else None, on="ratio").with_spread(res.summary["v3"]["e2e_rate"]))


def _us(sp: dict[str, Any]) -> str:
    if sp.get("median") is None:
        return "?"
    return f"{sp['median']:.0f} ({sp['min']:.0f}–{sp['max']:.0f})"

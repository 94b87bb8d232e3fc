"""slots-scaling: aggregate tokens/s with 1, 2 and 4 slots generating at once.

The engine puts one token of every decoding slot into one ``llama_decode`` (continuous
batching); the C++ queue serialises them. Each stream is a PIN DECODE on its own
connection. The aggregate rate is counted in the steady window where every stream is
producing (from the last stream's first piece to the first stream's last piece), so
prefills and stragglers do not blur it. Baseline: the single stream, interleaved.
"""
from __future__ import annotations

import asyncio

from .common import BenchContext, Result, Row, interleaved, now, ratio, spread
from .procs import HydraServer, run_worker
from .traffic import PinRun, messages_for, pin_decode, steady_rate

NAME = "slots-scaling"
COUNTS = [1, 2, 4]


def aggregate_rate(runs: list[PinRun]) -> float | None:
    """Tokens of all streams per second, inside the window where all of them were producing."""
    return steady_rate([r.times for r in runs])


SLOT_CTX = 4096


async def _bare(ctx: BenchContext, model: str, n: int, cap_s: float) -> list[dict]:
    """The bare batched loop's rounds, in the same interleaved order as the server's."""
    order = interleaved(ctx.reps, COUNTS)
    out = await run_worker("bare-batch", {
        "model": model, "n_ctx": SLOT_CTX * max(COUNTS), "n_seq_max": max(COUNTS), "n_threads": ctx.threads,
        "messages": [messages_for(i) for i in range(max(COUNTS))], "n_predict": n, "max_seconds": cap_s,
        "rounds": [k for _, k in order]}, timeout=len(order) * cap_s * 4 + 120)
    return [{"rep": rep, "streams": k, "aggregate_tok_s": r["aggregate_tok_s"], "steps": r["steps"]}
            for (rep, k), r in zip(order, out["rounds"])]


async def _measure(ctx: BenchContext, model: str, n: int, cap_s: float) -> list[dict]:
    rounds = []
    with HydraServer(["--model", model, "--slots", str(max(COUNTS)), "--ctx", str(SLOT_CTX),
                      "--threads", str(ctx.threads), "--fixed-threads"]) as srv:
        await asyncio.gather(*(pin_decode(srv.host, srv.port, i, 32, messages_for(i)) for i in range(max(COUNTS))))
        for rep, k in interleaved(ctx.reps, COUNTS):
            until = now() + cap_s  # a busy host must not stretch a round into minutes
            runs = await asyncio.gather(*(pin_decode(srv.host, srv.port, i, n, messages_for(i), until=until)
                                          for i in range(k)))
            for r in runs:
                r.check(n)
            rounds.append({"rep": rep, "streams": k, "aggregate_tok_s": aggregate_rate(runs),
                           "per_stream_tok_s": [r.decode_rate() for r in runs], "tokens": [r.tokens for r in runs]})
    return rounds


SCALING_BUDGET = 2.8  # 4 slots' aggregate tok/s over 1 slot's (tiny-small, or the real model)


async def run(ctx: BenchContext) -> Result:
    res = Result(NAME)
    ms = ctx.models
    # The budget is about batching amortising llama.cpp's per-token work, which dominates
    # for real models. The tiny model (~0.1 ms/token) is bound by our per-token Python
    # instead, which batching cannot amortise: measured too, for contrast, without a budget.
    models = [("tiny-small", ms.busy, True), ("tiny", ms.main, False)] if ms.tiny else [(ms.label, ms.main, True)]
    n = ctx.pick(1000 if ms.tiny else 128, 200 if ms.tiny else 32)
    cap_s = ctx.pick(6.0, 2.0)
    res.config = {"models": {name: path for name, path, _ in models}, "n_predict_per_stream": n, "cap_seconds": cap_s,
                  "threads": ctx.threads, "reps": ctx.reps, "counts": COUNTS, "slots": max(COUNTS)}
    res.samples = {"rounds": [], "bare_rounds": []}
    for name, path, budgeted in models:
        rounds = await _measure(ctx, path, n, cap_s)
        bare = await _bare(ctx, path, n, cap_s)
        res.samples["rounds"] += [{"model": name, **r} for r in rounds]
        res.samples["bare_rounds"] += [{"model": name, **r} for r in bare]
        agg = {k: spread(r["aggregate_tok_s"] for r in rounds if r["streams"] == k) for k in COUNTS}
        bare_agg = {k: spread(r["aggregate_tok_s"] for r in bare if r["streams"] == k) for k in COUNTS}
        res.summary[name] = {"aggregate_tok_s": {str(k): v for k, v in agg.items()},
                             "bare_aggregate_tok_s": {str(k): v for k, v in bare_agg.items()}}
        k_max = max(COUNTS)
        bare_scaling = ratio(bare_agg[k_max]["median"], bare_agg[1]["median"])
        res.rows.append(Row(f"bare loop: aggregate tok/s, {k_max} sequences per llama_decode ({name})",
                            bare_agg[k_max]["median"], "tok/s", bare_agg[1]["median"], "1 sequence",
                            note=f"the ceiling of batching on this machine: {bare_scaling or 0:.2f}× of 1 sequence, "
                                 "no server, no clients").with_spread(bare_agg[k_max]))
        res.rows.append(Row(f"aggregate tok/s, {k_max} slots vs the bare loop's {k_max} sequences ({name})",
                            agg[k_max]["median"], "tok/s", bare_agg[k_max]["median"], f"bare, {k_max} sequences",
                            note="what the server keeps of llama.cpp's batching (streams, event loop and "
                                 "clients on the same cores)").with_spread(agg[k_max]))
        one = agg[1]["median"]
        for k in COUNTS[1:]:
            v = agg[k]["median"]
            q = ratio(v, one)
            budgeted_row = k == 4 and budgeted
            note = "" if v is not None else "no steady window"
            if not budgeted:
                note += "bound by per-token Python, not llama.cpp: no budget"
            res.rows.append(Row(f"aggregate tok/s, {k} slots decoding at once ({name})", v, "tok/s", one, "1 slot",
                                f"aggregate ≥ {SCALING_BUDGET}× of 1 slot" if budgeted_row else "", note=note,
                                limit=SCALING_BUDGET if budgeted_row and q is not None else None,
                                on="ratio").with_spread(agg[k]))
    return res

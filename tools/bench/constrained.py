"""constrained: grammar-constrained decoding and streamed tool-call/reasoning parsing vs plain decoding.

One streamed ``/v1/chat/completions`` request per sample, the same user message, greedy,
the same ``max_tokens``, on a server with one slot (``--parallel 1``, ``--fixed-threads``). On
a server started with a Hermes-form chat template (``tests/templates/hermes.jinja``):

* ``plain``: unconstrained — the baseline of the three below;
* ``grammar``: a GBNF of lines of lowercase words (the tiny random model writes it to
  ``max_tokens``; a JSON array of strings it closes after a few dozen tokens);
* ``json_schema``: an array of at least 50 short strings (the grammar the server builds from
  the schema; ``response_format: json_schema`` builds the same one);
* ``tools``: one tool, ``tool_choice: "required"``: the tool-call grammar forces a well-formed
  ``<tool_call>`` JSON call (its array of notes has a fixed length, so the call ends before
  ``max_tokens`` with the tiny model), and the stream parses it into ``delta.tool_calls``.
  Its baseline is ``tools-none``: the same request with ``tool_choice: "none"`` — the same
  prompt (the template lists the tool: ~600 tokens instead of ~120), unconstrained, no parse.
  Against ``plain`` the longer context alone halves the tiny model's tok/s (attention over
  the prompt dominates its per-token cost), which is not the constraint's doing.

And, on a server with a Qwen 3.5-form template whose generation prompt opens ``<think>``:

* ``reasoning``: the answer streamed as ``delta.reasoning_content`` (parsed token by token),
  against ``reasoning-none`` — the same request with ``reasoning_format: "none"``: the same
  prompt and so the same tokens, only without the parse.

Decode tok/s is counted from the chunk that carries the first token (the role chunk goes
out with it) to the chunk that closes the stream (``finish_reason``, after the final parse):
``(completion_tokens - 1) / span``. Not from the first and last *content* delta: the tool-call
parse holds text back until it knows the call's name, so its deltas are not one per token.
The server's own ``timings.predicted_per_second`` is kept next to it. Where the CPU goes:
the server's main thread (the event loop: HTTP, SSE, the stream parse) and its other threads
(inference, with the grammar, and ggml's compute threads), per generated token, read from
``/proc`` before and after each batch of requests (a tick is 10 ms: one request is too short).

Each repetition runs a batch of requests per variant, the variants interleaved (rotating)
within a server; ratios are taken per repetition against the same repetition's baseline.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.spawn import ROOT, cpu_used

from .common import BenchContext, BenchError, Result, Row, interleaved, now, ratio, spread
from .procs import HydraServer
from .traffic import sse_events

NAME = "constrained"
TEMPLATES = Path(ROOT) / "tests" / "templates"
HERMES = TEMPLATES / "hermes.jinja"
REASONING_TEMPLATE = TEMPLATES / "qwen35_xml.jinja"
MAX_TOKENS = 256
MIN_TOKENS = 100  # a variant that generates fewer is reported, not budgeted: too short to measure
MESSAGES = [{"role": "user", "content": "List what you know about the sea, one short line each."}]
GRAMMAR = r'root ::= ([a-z ]{1,20} "\n")+'
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 50}
NOTES = 6  # the tool call's array length: a complete call in ~200 tokens of the tiny model
TOOLS = [{"type": "function", "function": {
    "name": "record_notes", "description": "Record short notes about a subject.",
    "parameters": {"type": "object", "required": ["notes"], "properties": {
        "notes": {"type": "array", "minItems": NOTES, "maxItems": NOTES,
                  "items": {"type": "string", "maxLength": 20}}}}}}]
BUDGET = 0.7  # constrained decode tok/s ≥ this share of unconstrained decode (same run)

SERVERS: dict[str, dict[str, Any]] = {
    # server → its variants (the first is the baseline) and their request fields
    "hermes": {"template": HERMES, "variants": {
        "plain": {},
        "grammar": {"grammar": GRAMMAR},
        "json_schema": {"json_schema": SCHEMA},
        "tools-none": {"tools": TOOLS, "tool_choice": "none"},
        "tools": {"tools": TOOLS, "tool_choice": "required"},
    }},
    "reasoning": {"template": REASONING_TEMPLATE, "variants": {
        "reasoning-none": {"reasoning_format": "none"},
        "reasoning": {},
    }},
}
BASELINE = {"grammar": "plain", "json_schema": "plain", "tools": "tools-none", "reasoning": "reasoning-none"}
BASELINE_LABELS = {"plain": "unconstrained", "tools-none": "unconstrained, same prompt (tool_choice none)",
                   "reasoning-none": "reasoning_format none (same tokens)"}
BUDGETED = ("grammar", "json_schema", "tools")
LABELS = {"grammar": "GBNF grammar (lines of words)", "json_schema": "json_schema (array of ≥ 50 strings)",
          "tools": "tool call, tool_choice required (Hermes)", "reasoning": "reasoning_content parse (<think>)"}


async def chat(http: Any, base: str, fields: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: tokens, the client-side decode rate, what the deltas carried."""
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **fields}
    t0 = now()
    first = last = None
    kinds: dict[str, int] = {}
    finish, timings, usage = None, {}, {}
    async for t, ev in sse_events(http, f"{base}/v1/chat/completions", body):
        if "error" in ev:
            raise BenchError(f"in-band error: {str(ev['error'])[:300]}")
        usage = ev.get("usage") or usage
        for ch in ev.get("choices") or []:
            first = t if first is None else first
            for k, v in (ch.get("delta") or {}).items():
                if v and k != "role":
                    kinds[k] = kinds.get(k, 0) + 1
            if ch.get("finish_reason"):
                finish, last = ch["finish_reason"], t
                timings = ev.get("timings") or timings
    n = usage.get("completion_tokens") or timings.get("predicted_n") or 0
    span = (last - first) if first is not None and last is not None else 0.0
    return {"tokens": n, "prompt_tokens": usage.get("prompt_tokens"),
            "decode_rate": (n - 1) / span if n > 1 and span > 0 else None,
            "server_rate": timings.get("predicted_per_second"), "ttft_ms": round(((first or t0) - t0) * 1000, 3),
            "finish": finish, "deltas": kinds}


async def batch(srv: HydraServer, http: Any, base: str, fields: dict[str, Any], k: int, max_tokens: int
                ) -> dict[str, Any]:
    """``k`` requests back to back; the server's CPU per token over all of them."""
    before = srv.thread_cpu()
    reqs = [await chat(http, base, fields, max_tokens) for _ in range(k)]
    after = srv.thread_cpu()
    tokens = sum(r["tokens"] for r in reqs)
    per = 1e6 / max(tokens, 1)
    rates = [r["decode_rate"] for r in reqs]
    return {"decode_rate": spread(rates)["median"], "server_rate": spread(r["server_rate"] for r in reqs)["median"],
            "tokens": tokens / k, "requests": reqs,
            "cpu_us_per_token": {"loop": (after.get(srv.pid, 0.0) - before.get(srv.pid, 0.0)) * per,
                                 "compute": cpu_used(before, after, skip=(srv.pid,)) * per}}


async def run(ctx: BenchContext) -> Result:
    import aiohttp

    res = Result(NAME)
    if not ctx.http:
        raise BenchError("this build has no HTTP side (hydra_rpc.http.app)")
    k = ctx.pick(8, 1)  # requests per variant and repetition (a CPU tick is 10 ms: ~2,000 tokens)
    max_tokens = ctx.pick(MAX_TOKENS, 96)  # --quick: enough for a call's name and a think block
    model = ctx.models.main
    runs: list[dict[str, Any]] = []
    res.config = {"model": model, "max_tokens": max_tokens, "requests_per_rep": k, "reps": ctx.reps,
                  "threads": ctx.threads, "slots": 1, "messages": MESSAGES, "budget_ratio": BUDGET,
                  "servers": {s: {"template": str(Path(c["template"]).relative_to(ROOT)),
                                  "variants": c["variants"]} for s, c in SERVERS.items()}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for name, conf in SERVERS.items():
            args = ["--model", model, "--parallel", "1", "--threads", str(ctx.threads), "--fixed-threads",
                    "--chat-template-file", str(conf["template"])]
            with HydraServer(args, http=True) as srv:
                base = f"http://127.0.0.1:{srv.http_port}"
                variants = list(conf["variants"])
                for v in variants:  # warm-up: first requests, grammar set-up
                    await chat(http, base, conf["variants"][v], max_tokens)
                for rep, v in interleaved(ctx.reps, variants):
                    out = await batch(srv, http, base, conf["variants"][v], k, max_tokens)
                    runs.append({"server": name, "variant": v, "rep": rep, **out})
    res.samples = {"runs": runs}
    _summarize(res, runs)
    return res


def _summarize(res: Result, runs: list[dict[str, Any]]) -> None:
    variants = [v for conf in SERVERS.values() for v in conf["variants"]]

    def of(v: str) -> list[dict]:
        return [r for r in runs if r["variant"] == v]

    def per_rep_ratio(v: str, key: str) -> dict:
        by_rep: dict[int, dict[str, Any]] = {}
        for r in runs:
            by_rep.setdefault(r["rep"], {})[r["variant"]] = r.get(key)
        return spread(ratio(p.get(v), p.get(BASELINE[v])) for p in by_rep.values())

    s: dict[str, Any] = {}
    for v in variants:
        reqs = [q for r in of(v) for q in r["requests"]]
        s[v] = {"decode_rate": spread(r["decode_rate"] for r in of(v)),
                "server_rate": spread(r["server_rate"] for r in of(v)),
                "tokens": spread(q["tokens"] for q in reqs),
                "prompt_tokens": spread(q["prompt_tokens"] for q in reqs),
                "finish": sorted({q["finish"] for q in reqs if q["finish"]}),
                "deltas": sorted({d for q in reqs for d in q["deltas"]}),
                "loop_us_per_token": spread(r["cpu_us_per_token"]["loop"] for r in of(v)),
                "compute_us_per_token": spread(r["cpu_us_per_token"]["compute"] for r in of(v))}
        if v in BASELINE:
            s[v]["ratio_per_rep"] = per_rep_ratio(v, "decode_rate")
            s[v]["server_ratio_per_rep"] = per_rep_ratio(v, "server_rate")
    res.summary = s
    for v in (*BUDGETED, "reasoning"):
        b = BASELINE[v]
        val, base = s[v]["decode_rate"]["median"], s[b]["decode_rate"]["median"]
        toks = s[v]["tokens"]["median"] or 0
        short = toks < MIN_TOKENS
        rr, sr = s[v]["ratio_per_rep"], s[v]["server_ratio_per_rep"]
        note = (f"per-rep ratio {_q(rr)}; server-side timings {_q(sr)}; {toks:.0f} tokens, "
                f"finish {'/'.join(s[v]['finish'])}" + (f"; fewer than {MIN_TOKENS} tokens: no budget" if short else ""))
        if b != "plain" and v in BUDGETED:
            note += f"; {ratio(val, s['plain']['decode_rate']['median']) or 0:.2f}× of plain (a shorter prompt)"
        budgeted = v in BUDGETED and not short and base
        res.rows.append(Row(f"streamed decode tok/s, {LABELS[v]}", val, "tok/s", base, BASELINE_LABELS[b],
                            f"≥ {BUDGET}× of unconstrained" if v in BUDGETED else "", note=note,
                            limit=BUDGET if budgeted else None, on="ratio").with_spread(s[v]["decode_rate"]))
    for v in ("tools", "reasoning"):
        b = BASELINE[v]
        loop, base = s[v]["loop_us_per_token"], s[b]["loop_us_per_token"]
        res.rows.append(Row(f"server event-loop CPU per token, {LABELS[v]}", loop["median"], "µs", base["median"],
                            BASELINE_LABELS[b],
                            note=f"inference + compute threads {_q(s[v]['compute_us_per_token'], 0)} µs vs "
                                 f"{_q(s[b]['compute_us_per_token'], 0)} µs").with_spread(loop))
    for v in ("grammar", "json_schema"):
        c, b = s[v]["compute_us_per_token"], s["plain"]["compute_us_per_token"]
        res.rows.append(Row(f"server inference + compute threads CPU per token, {LABELS[v]}", c["median"], "µs",
                            b["median"], "unconstrained",
                            note=f"event loop {_q(s[v]['loop_us_per_token'], 0)} µs vs "
                                 f"{_q(s['plain']['loop_us_per_token'], 0)} µs").with_spread(c))
    for v in variants:
        if v in BASELINE and (s[v]["tokens"]["median"] or 0) < MIN_TOKENS:
            res.notes.append(f"{v}: only {s[v]['tokens']['median']} tokens per request (finish "
                             f"{'/'.join(s[v]['finish'])}): its tok/s is over fewer than {MIN_TOKENS} tokens.")


def _q(sp: dict[str, Any], nd: int = 2) -> str:
    """median (min–max)."""
    if sp.get("median") is None:
        return "?"
    return f"{sp['median']:.{nd}f} ({sp['min']:.{nd}f}–{sp['max']:.{nd}f})"

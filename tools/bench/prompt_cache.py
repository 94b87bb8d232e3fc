"""prompt-cache: multi-turn conversations sharing a long system prompt, with and without the cache.

Four conversations share one ~2,000-token system prompt (500 with ``--quick``) and take turns (A1 B1 C1 D1 A2 B2 …)
on a server with two slots, so every returning conversation finds its slot taken by another
one: its history comes back from the RAM tier (``--cache-ram``), a new conversation's system
prompt from another slot (``llama_memory_seq_cp``). The baseline is the same server with
``--no-cache-prompt``, which computes every prompt whole — the same run, its repetitions
interleaved with the cached server's. Each turn is a streamed ``/v1/completions`` request
(greedy, a few tokens): time to first token is measured by the client, prefill time is the
server's ``timings.prompt_ms``, cached tokens its ``timings.cache_n``. Every repetition uses
its own system prompt, so nothing carries over from the one before.
"""
from __future__ import annotations

from typing import Any

from .common import BenchContext, BenchError, Result, Row, interleaved, ratio, spread, summarize
from . import openai_workload
from .procs import HydraServer

NAME = "prompt-cache"
VARIANTS = ["cache", "no-cache"]
CONVERSATIONS = "ABCD"
SLOTS = 2
SYSTEM_TOKENS = 2000
WORDS = ("answer", "briefly", "clearly", "politely", "with", "care", "and", "cite", "the", "manual", "when",
         "asked", "about", "pumps", "valves", "pressure", "or", "flow")


def system_prompt(rep: int, n_words: int) -> str:
    words = " ".join(WORDS[(i * 7 + rep) % len(WORDS)] for i in range(n_words))
    return f"Session {rep}. You are the support assistant of a pump maker. Rules: {words}.\n"


def user_turn(conv: str, turn: int) -> str:
    return f"\nUser {conv}: question {turn} of conversation {conv}: how do I bleed valve {turn}?\nAssistant:"


async def completion(http: Any, base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion (:func:`tools.bench.openai_workload.completion`): its text,
    client-side TTFT (the total when nothing came) and total, and the server's timings."""
    r = await openai_workload.completion(http, base, prompt, max_tokens)
    total_ms = (r["t_end"] - r["t_send"]) * 1000
    timings = r["timings"]
    return {"text": r["text"], "ttft_ms": round(r["ttft_ms"] if r["ttft_ms"] is not None else total_ms, 3),
            "total_ms": round(total_ms, 3), "prompt_ms": timings.get("prompt_ms"),
            "cache_n": timings.get("cache_n"), "prompt_n": timings.get("prompt_n")}


async def calibrate(http: Any, base: str, target: int) -> int:
    """Words of system prompt for about ``target`` tokens with this model's tokenizer."""
    n = target // 2
    for _ in range(3):
        r = await completion(http, base, system_prompt(0, n), 1)
        tokens = (r["cache_n"] or 0) + (r["prompt_n"] or 0)
        if not tokens:
            raise BenchError("the server reported no prompt tokens")
        if abs(tokens - target) <= target // 50:
            break
        n = max(1, round(n * target / tokens))
    return n


async def conversations(http: Any, base: str, rep: int, n_words: int, turns: int, max_tokens: int) -> list[dict]:
    system = system_prompt(rep, n_words)
    history = {c: system for c in CONVERSATIONS}
    out = []
    for turn in range(turns):
        for c in CONVERSATIONS:
            prompt = history[c] + user_turn(c, turn)
            r = await completion(http, base, prompt, max_tokens)
            history[c] = prompt + r.pop("text")
            out.append({"conversation": c, "turn": turn, **r})
    return out


def _variant_summary(turns: list[dict]) -> dict[str, Any]:
    def per_rep_total(key: str) -> dict:
        reps = sorted({t["rep"] for t in turns})
        return spread(sum(t[key] or 0 for t in turns if t["rep"] == r) for r in reps)

    return {"prefill_total_ms": per_rep_total("prompt_ms"), "ttft_total_ms": per_rep_total("ttft_ms"),
            "ttft_first_turn_ms": summarize(t["ttft_ms"] for t in turns if t["turn"] == 0),
            "ttft_returning_ms": summarize(t["ttft_ms"] for t in turns if t["turn"] > 0),
            "cached_tokens_total": per_rep_total("cache_n"), "computed_tokens_total": per_rep_total("prompt_n")}


async def run(ctx: BenchContext) -> Result:
    import aiohttp

    res = Result(NAME)
    model = ctx.models.busy if ctx.models.tiny else ctx.models.main  # tiny mode: tiny-small
    turns, max_tokens = ctx.pick(4, 2), ctx.pick(16, 8)
    system_tokens = ctx.pick(SYSTEM_TOKENS, SYSTEM_TOKENS // 4)  # --quick: seconds, not minutes, without the cache
    args = ["--model", model, "--parallel", str(SLOTS), "--kv-unified", "--kv-unified-per-slot", "4096", "--threads",
            str(ctx.threads)]
    runs: list[dict] = []
    with HydraServer(args, http=True) as cached, HydraServer(args + ["--no-cache-prompt"], http=True) as plain:
        bases = {"cache": f"http://127.0.0.1:{cached.http_port}", "no-cache": f"http://127.0.0.1:{plain.http_port}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
            n_words = await calibrate(http, bases["no-cache"], system_tokens)
            await completion(http, bases["cache"], "warm up", 1)
            for rep, v in interleaved(ctx.reps, VARIANTS):
                for t in await conversations(http, bases[v], rep + 1, n_words, turns, max_tokens):
                    runs.append({"variant": v, "rep": rep, **t})
        info = {}
        async with aiohttp.ClientSession() as http:
            info["metrics_tail"] = await openai_workload.prompt_cache_metrics(http, bases["cache"])
    res.config = {"model": model, "slots": SLOTS, "conversations": len(CONVERSATIONS), "turns": turns,
                  "system_tokens_target": system_tokens, "system_words": n_words, "max_tokens": max_tokens,
                  "reps": ctx.reps, "threads": ctx.threads, "variants": VARIANTS}
    res.samples = {"turns": runs, **info}
    res.summary = {v: _variant_summary([t for t in runs if t["variant"] == v]) for v in VARIANTS}
    c, n = res.summary["cache"], res.summary["no-cache"]
    pre, pre_base = c["prefill_total_ms"]["median"], n["prefill_total_ms"]["median"]
    q = ratio(pre_base, pre)
    res.rows.append(Row(f"total prefill time, {len(CONVERSATIONS)} conversations × {turns} turns", pre, "ms",
                        pre_base, "--no-cache-prompt", "≥ 3× less than without the cache",
                        None if q is None else q >= 3.0, f"{q:.1f}× less" if q else ""))
    back, back_base = c["ttft_returning_ms"].get("p50"), n["ttft_returning_ms"].get("p50")
    q = ratio(back_base, back)
    res.rows.append(Row("TTFT of a returning conversation (RAM tier), p50", back, "ms", back_base,
                        "--no-cache-prompt (recomputed)", "≥ 10× faster than recomputed",
                        None if q is None else q >= 10.0, f"{q:.1f}× faster" if q else ""))
    first, first_base = c["ttft_first_turn_ms"].get("p50"), n["ttft_first_turn_ms"].get("p50")
    res.rows.append(Row("TTFT of a conversation's first turn (shared system prompt), p50", first, "ms", first_base,
                        "--no-cache-prompt"))
    return res

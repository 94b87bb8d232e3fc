"""A stream's pauses while agents take turns on another slot: ours against llama-server.

    python -m tools.bench.swap_stall [--model tiny-hybrid-wide] [--agents 3] [--steps 4]
                                     [--rounds 2] [--batch N] [--out FILE]
    python -m tools.bench.swap_stall --table DIR     # the runs DIR/run-N.json in one table

A fleet node holds more agents' conversations than it has slots, so a slot changes hands on
nearly every turn: the leaving conversation's state is saved (with its context checkpoints, on
a hybrid model) and the coming one's restored. Both happen between decode steps, so every
other slot's stream waits for them. This measures that wait.

Both servers are up at once on one argv, ``-m MODEL --host 127.0.0.1 --port P -c 32768 -np 2
-t THREADS --chat-template-file …`` (Qwen 3.5's template, as :mod:`tools.bench.agent_turns`;
ours through ``hydra-llama-engine`` with ``--rpc-port 0``), each idle while the other runs a
round. In a round, a **stream** (``/v1/completions``, greedy, up to ``STREAM_TOKENS``) decodes
on one slot while ``--agents`` new agents take ``--steps`` steps each, one turn at a time. No
request names a slot: the agents' only free slot is the other one, so every turn moves a
conversation out of it and another in. Each turn is an agent's whole conversation with two
tools, ``AGENT_TOKENS`` tokens of reply. The stream is cut when the last turn ends. The servers' order rotates every round.

Per round and server, over the window from the first turn's send to the last turn's end: the
gaps between the stream's tokens (median, 99th percentile, longest), its tokens per second,
and the agents' turn times. Reports each server's medians over the rounds and ours' ratio to
llama-server's: a Markdown table, and everything in the JSON that ``--out`` writes.

``--batch N`` gives both servers ``-b N``: a step takes at most N tokens, the stream's next
token among them, so an agent's new prompt is computed over several steps with a token of the
stream in each (both servers fill a step that way). It bounds the stream's longest pause at the cost of the
agents' turns.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

import aiohttp

from tools.bench.agent_turns import TOOLS, AgentServers, opening, step_messages
from tools.bench.common import (MODEL_HELP, BenchError, min_max_text, now, parse_against_llama_server, percentile,
                                report_run, table_only)
from tools.bench.openai_workload import stream
from tools.bench.traffic import sse_events

STREAM_TOKENS = 8000  # more than a round needs: the stream is cut when the agents are done
AGENT_TOKENS = 8
REQUEST_TIMEOUT_S = 600.0
FIGURES = ("gap_max_ms", "gap_p99_ms", "gap_median_ms", "stream_tok_s", "turn_ms")
FIGURE_NAMES = {"gap_max_ms": "stream: longest gap between tokens (ms)",
                "gap_p99_ms": "stream: gaps between tokens, p99 (ms)",
                "gap_median_ms": "stream: gaps between tokens, median (ms)",
                "stream_tok_s": "stream: tokens per second", "turn_ms": "agent's turn, median (ms)"}


async def _stream_into(http: Any, base: str, prompt: str, times: list[float]) -> None:
    """The stream, each token's arrival appended to ``times`` as it comes."""
    body = {"prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True}
    async for t, ev in sse_events(http, f"{base}/v1/completions", body):
        if "error" in ev:
            raise BenchError(f"in-band error: {str(ev['error'])[:300]}")
        if any(ch.get("text") for ch in ev.get("choices") or []):
            times.append(t)


def window_figures(times: list[float], t0: float, t1: float, turns_ms: list[float]) -> dict[str, Any]:
    """The stream's gaps and rate between ``t0`` and ``t1``, and the turns' median."""
    inside = [t for t in times if t0 <= t <= t1]
    if len(inside) < 2:
        raise BenchError(f"the stream gave {len(inside)} tokens while the agents took their turns")
    gaps = [(b - a) * 1000 for a, b in zip(inside, inside[1:])]
    return {"gap_max_ms": round(max(gaps), 2), "gap_p99_ms": round(percentile(gaps, 99), 2),
            "gap_median_ms": round(statistics.median(gaps), 3),
            "stream_tok_s": round((len(inside) - 1) / (inside[-1] - inside[0]), 2),
            "turn_ms": round(statistics.median(turns_ms), 1), "tokens_in_window": len(inside),
            "stream_covered": bool(times) and times[-1] >= t1 - 0.5}


async def one_round(base: str, first_agent: int, agents: int, steps: int) -> dict[str, Any]:
    """A stream on one slot while ``agents`` new agents take ``steps`` steps each on the other."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as http:
        times: list[float] = []
        streamer = asyncio.create_task(_stream_into(http, base, f"Story number {first_agent}: once upon a time",
                                                    times))
        try:
            while not times:  # the stream decodes before the first turn
                if streamer.done():
                    streamer.result()
                    raise BenchError("the stream ended before its first token")
                await asyncio.sleep(0.01)
            conversations = {a: opening(a) for a in range(first_agent, first_agent + agents)}
            turns_ms: list[float] = []
            cached: list[Any] = []
            t0 = now()
            for step in range(steps):
                for a, conversation in conversations.items():
                    if step:
                        conversation += step_messages(a, step - 1)
                    reply = await stream(http, base, "/v1/chat/completions",
                                         {"messages": conversation, "tools": TOOLS, "max_tokens": AGENT_TOKENS})
                    turns_ms.append((reply["t_end"] - reply["t_send"]) * 1000)
                    cached.append(reply["timings"].get("cache_n"))
            t1 = now()
        finally:
            streamer.cancel()
            await asyncio.gather(streamer, return_exceptions=True)
    return {**window_figures(times, t0, t1, turns_ms), "turns_ms": [round(x, 1) for x in turns_ms],
            "cache_n": cached}


def summarize(rounds: dict[str, list[dict[str, Any]]], base: str = "llama-server") -> dict[str, Any]:
    """Per figure: each server's median over its rounds, and ours' ratio to ``base``'s."""
    out: dict[str, Any] = {}
    for figure in FIGURES:
        medians = {k: statistics.median(r[figure] for r in rs) for k, rs in rounds.items()}
        out[figure] = {k: {"median": round(m, 3), "ratio": round(m / medians[base], 3) if medians[base] else None}
                       for k, m in medians.items()}
    return out


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Several runs in one table: per figure, each server's medians and ours' ratio, min–max."""
    lines = ["| figure | llama-server | ours | ours / llama-server |", "|---|---|---|---|"]
    for figure in FIGURES:
        cells = [r["summary"][figure] for r in runs]
        ls = min_max_text([c["llama-server"]["median"] for c in cells], ".1f")
        ours = min_max_text([c["ours"]["median"] for c in cells], ".1f")
        ratio = min_max_text([c["ours"]["ratio"] for c in cells], ".3f")
        lines.append(f"| {FIGURE_NAMES[figure]} | {ls} | {ours} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.swap_stall", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-hybrid-wide", help=MODEL_HELP)
    ap.add_argument("--agents", type=int, default=3, help="agents taking turns on the other slot in a round")
    ap.add_argument("--steps", type=int, default=4, help="turns per agent in a round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per server, the order rotating")
    ap.add_argument("--batch", type=int, metavar="N", help="both servers get -b N: at most N tokens a step, so an "
                    "agent's new prompt is computed in steps of N with the stream's next token in each")
    args = parse_against_llama_server(ap, argv)
    if (shown := table_only(args, runs_table)) is not None:
        return shown
    agent_servers = AgentServers(args.model, args.threads)
    rounds = agent_servers.rounds(args.rounds, args.batch,
                                  lambda base, rep, _: one_round(base, 100 * (rep + 1), args.agents, args.steps))
    if not all(r["stream_covered"] for rs in rounds.values() for r in rs):
        raise BenchError("a stream ended before the agents' last turn: raise STREAM_TOKENS")
    result = {**agent_servers.described(), "batch": args.batch, "agents": args.agents, "steps": args.steps,
              "summary": summarize(rounds), "rounds": rounds}
    return report_run(args.out, result, runs_table)


if __name__ == "__main__":
    main()

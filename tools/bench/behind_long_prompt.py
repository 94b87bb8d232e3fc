"""A short request sent while another slot computes a long prompt: ours against llama-server.

    python -m tools.bench.behind_long_prompt [--model tiny-hybrid-wide] [--rounds 3]
                                             [--long-words 350] [--delay 1.0] [--out FILE]
    python -m tools.bench.behind_long_prompt --table DIR   # the runs DIR/run-N.json in one table

An agent's first turn on a fleet node is a long prompt (system prompt, tools, history) that
nothing cached; the node's other agents go on with short turns meanwhile. A step computes at
most ``-b`` prompt tokens, so a long prompt takes many steps. Which prompt gets a step's
tokens decides how long a short request that arrives behind it waits for its first token.

Both servers are up at once on the agents' argv (:class:`tools.bench.agent_turns.AgentServers`:
``-c 32768 -np 2 -t THREADS``, Qwen 3.5's template; ``--batch N`` adds ``-b N`` to both), each
idle while the other runs a round; the order rotates every round. In a round a **long**
completion (``--long-words`` words never sent before) is sent, and ``--delay`` seconds later
a **short** one (a few words); each asks for one token. Per round: the time from each
request's send to its token. Reports each server's median and largest over the rounds,
ours' ratio to llama-server's: a Markdown table, and everything in the JSON ``--out`` writes.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

import aiohttp

from tools.bench.agent_turns import SERVERS, AgentServers
from tools.bench.common import MODEL_HELP, min_max_text, parse_against_llama_server, report_run, table_only
from tools.bench.openai_workload import stream

REQUEST_TIMEOUT_S = 900.0
FIGURES = ("short_ms", "long_ms")
FIGURE_NAMES = {"short_ms": "short request behind the long prompt: its token (ms)",
                "long_ms": "the long prompt: its token (ms)"}


def long_text(words: int, salt: int) -> str:
    """A prompt no earlier round sent: its first word differs, so nothing of it is cached."""
    return f"Document {salt}. " + " ".join(f"item{(i * 7 + salt) % 997} holds {i % 13} units;" for i in range(words))


async def one_round(base: str, salt: int, words: int, delay: float) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        long = asyncio.ensure_future(stream(http, base, "/v1/completions",
                                            {"prompt": long_text(words, salt), "max_tokens": 1}))
        await asyncio.sleep(delay)
        short = await stream(http, base, "/v1/completions", {"prompt": f"Question {salt}: what is two and two?",
                                                               "max_tokens": 1})
        done = await long
    # one token each: the answer's end is its first token (whose text may be empty)
    return {"short_ms": round((short["t_end"] - short["t_send"]) * 1000, 1),
            "long_ms": round((done["t_end"] - done["t_send"]) * 1000, 1), "long_prompt_tokens": done["prompt_tokens"],
            "short_sent_before_long_ended": short["t_send"] < done["t_end"]}


def summarize(rounds: dict[str, list[dict[str, Any]]], base: str = "llama-server") -> dict[str, Any]:
    """Per figure: each server's median and largest over its rounds, ours' ratios to ``base``'s."""
    out: dict[str, Any] = {}
    for figure in FIGURES:
        stats = {k: {"median": statistics.median(r[figure] for r in rs), "max": max(r[figure] for r in rs)}
                 for k, rs in rounds.items()}
        out[figure] = {k: {**s, "ratio": round(s["median"] / stats[base]["median"], 3),
                           "ratio_max": round(s["max"] / stats[base]["max"], 3)} for k, s in stats.items()}
    return out


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Several runs in one table: per figure, each server's median (largest) and ours' ratio, min–max."""
    lines = ["| figure | llama-server: median (largest) | ours: median (largest) | ours / llama-server: median "
             "(largest) |", "|---|---|---|---|"]
    for figure in FIGURES:
        cells = [r["summary"][figure] for r in runs]
        ls, ours = ([c[k] for c in cells] for k in SERVERS)
        lines.append(f"| {FIGURE_NAMES[figure]} | {min_max_text([c['median'] for c in ls], '.0f')} "
                     f"({min_max_text([c['max'] for c in ls], '.0f')}) | "
                     f"{min_max_text([c['median'] for c in ours], '.0f')} "
                     f"({min_max_text([c['max'] for c in ours], '.0f')}) | "
                     f"{min_max_text([c['ratio'] for c in ours], '.3f')} "
                     f"({min_max_text([c['ratio_max'] for c in ours], '.3f')}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.behind_long_prompt",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-hybrid-wide", help=MODEL_HELP)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per server, the order rotating")
    ap.add_argument("--long-words", type=int, default=350, help="the long prompt's length in words")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds from the long request to the short one")
    ap.add_argument("--batch", type=int, metavar="N", help="both servers get -b N")
    args = parse_against_llama_server(ap, argv)
    if (shown := table_only(args, runs_table)) is not None:
        return shown
    agent_servers = AgentServers(args.model, args.threads)
    rounds = agent_servers.rounds(args.rounds, args.batch, lambda base, rep, k: one_round(
        base, 1000 * (rep + 1) + SERVERS.index(k), args.long_words, args.delay))
    result = {**agent_servers.described(), "batch": args.batch, "long_words": args.long_words, "delay_s": args.delay,
              "summary": summarize(rounds), "rounds": rounds}
    return report_run(args.out, result, runs_table)


if __name__ == "__main__":
    main()

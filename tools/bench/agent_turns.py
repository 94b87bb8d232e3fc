"""The fleet's traffic: agents' turns over ``/v1/chat/completions`` with tools, ours against
llama-server.

    python -m tools.bench.agent_turns [--model tiny-hybrid-wide] [--agents 1,2] [--turns 12]
                                      [--max-tokens 32] [--cache-ram MIB] [--out FILE]
    python -m tools.bench.agent_turns --table DIR     # the runs DIR/run-N.json in one table

An agent sends its whole conversation back every turn: the system prompt, its task, then each
of its earlier steps — the reasoning and tool call it made (as the client echoes them) and the
tool's result, a file of 13 lines. Each request carries two tools and asks for ``--max-tokens``
tokens, streamed and greedy, through Qwen 3.5's chat template (``tests/templates/qwen35_xml.jinja``,
the fleet model's family: a think block, tools in XML), so a turn is a prefill of the new step
after a cached prefix — on a hybrid model, from a context checkpoint — and a short reply.

Both servers are up at once on one argv, ``-m MODEL --host 127.0.0.1 --port P -c 32768 -np 2
-t THREADS --chat-template-file …`` (ours through ``hydra-llama-engine`` with ``--rpc-port 0``),
each idle while the other serves. For each number of agents (``--agents``), each server holds
that many conversations; turn by turn every agent takes one step at once, on one server, then
on the other, the order swapping every turn. The agents' texts are the same on both servers,
whatever the model answers, so both compute the same prompts.

Per turn and server: the turn's wall time (from the requests' send to the last reply's end) and
the agents' times to first token, with the servers' own ``prompt_n``, ``cache_n`` and
``prompt_ms``. Reports the medians and the per-turn ratio ours / llama-server (median, min–max):
a Markdown table, and everything in the JSON that ``--out`` writes.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from tools.bench.common import (MODEL_HELP, BenchError, interleaved, machine_info, min_max_text,
                                parse_against_llama_server, report_run, table_only)
from tools.bench.llama_server import build_info, llama_server_or_exit, servers_running
from tools.bench.models import model_set
from tools.bench.openai_workload import prompt_cache_metrics, stream
from tools.bench.vs_llama_server import start
from tools.spawn import ROOT

TEMPLATE = ROOT / "tests" / "templates" / "qwen35_xml.jinja"
CTX, SLOTS = 32768, 2  # 16,384 tokens per conversation: twelve steps of tiny-hybrid-wide take ~8,500
SERVERS = ("llama-server", "ours")
FIGURES = ("wall_ms", "ttft_ms")
FIGURE_NAMES = {"wall_ms": "turn, send to last reply's end", "ttft_ms": "time to first token"}
REQUEST_TIMEOUT_S = 300.0

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                        "glob": {"type": "string"}}, "required": ["pattern"]}}},
]
SYSTEM = "You are a coding agent working in a repository. Call one tool at a time and read before you edit. " + \
    " ".join(f"Rule {i}: keep each change small, test it, and say why in its commit message." for i in range(1, 13))


def opening(agent: int) -> list[dict[str, Any]]:
    """An agent's conversation before its first step."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Agent {agent}: find where service {agent} parses its port, and fix "
                                        f"the off-by-one there."}]


def file_text(agent: int, step: int) -> str:
    """What a tool returns: a source file of 13 lines, different for every agent and step."""
    lines = [f"# src/service_{agent}/part_{step}.py"]
    for j in range(4):
        lines += [f"def parse_{step}_{j}(text, base={j + 2}):",
                  f"    value = int(text.strip() or '{agent * 100 + j}', base)",
                  f"    return value + {step} if value < {1024 + j} else value - {j}"]
    return "\n".join(lines) + "\n"


def step_messages(agent: int, step: int) -> list[dict[str, Any]]:
    """One step as the client sends it back: the assistant's reasoning and call, and the result."""
    call_id = f"call_{agent}_{step}"
    call = {"id": call_id, "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/service_{agent}/part_{step}.py"})}}
    return [{"role": "assistant", "content": "", "reasoning_content": f"Part {step} may parse the port.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": file_text(agent, step)}]


async def one_turn(http: Any, base: str, conversations: list[list[dict[str, Any]]], max_tokens: int
                   ) -> dict[str, Any]:
    """Every agent's next request at once; the wall time and what each reply recorded."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    replies = await asyncio.gather(*(stream(http, base, "/v1/chat/completions",
                                            {"messages": c, "tools": TOOLS, "max_tokens": max_tokens})
                                     for c in conversations))
    wall_ms = (loop.time() - t0) * 1000
    if any(r["ttft_ms"] is None for r in replies):
        raise BenchError(f"a reply streamed no text (finish {[r['finish'] for r in replies]}): no first token to time")
    return {"wall_ms": round(wall_ms, 2), "ttft_ms": [round(r["ttft_ms"], 2) for r in replies],
            "tokens": [r["completion_tokens"] for r in replies],
            **{k: [r["timings"].get(k) for r in replies] for k in ("prompt_n", "cache_n", "prompt_ms")}}


async def measure(bases: dict[str, str], agents: int, turns: int, max_tokens: int) -> dict[str, list[dict[str, Any]]]:
    """{server: [turn, ...]}: ``agents`` conversations per server, each turn on every server in
    turn (the order swapping every turn), after an opening request each that is not counted."""
    names = list(bases)
    conversations = {k: [opening(a) for a in range(agents)] for k in names}
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    # a connection per request, as the bench's other clients: an idle kept-alive one may be closed
    # by the server just as it is reused
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as http:
        for k in names:
            await one_turn(http, bases[k], conversations[k], max_tokens)
        for step in range(turns):
            for k in (names if step % 2 == 0 else names[::-1]):
                for a, conversation in enumerate(conversations[k]):
                    conversation += step_messages(a, step)
                samples[k].append(await one_turn(http, bases[k], conversations[k], max_tokens))
    return samples


def _turn_figure(turn: dict[str, Any], figure: str) -> float:
    value = turn[figure]
    return statistics.median(value) if isinstance(value, list) else value


def summarize_turns(samples: dict[str, list[dict[str, Any]]], base: str = "llama-server") -> dict[str, Any]:
    """Per figure: each server's median, and the per-turn ratios to ``base`` (median, min, max)."""
    out: dict[str, Any] = {}
    for figure in FIGURES:
        ref = [_turn_figure(t, figure) for t in samples[base]]
        out[figure] = {}
        for k, turns in samples.items():
            values = [_turn_figure(t, figure) for t in turns]
            ratios = [v / r for v, r in zip(values, ref) if r]
            out[figure][k] = {"median": round(statistics.median(values), 2),
                              "ratio": round(statistics.median(ratios), 3),
                              "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
    prompt_n = [n for t in samples[base] for n in t["prompt_n"] if n is not None]
    out["prompt_n"] = [min(prompt_n), max(prompt_n)] if prompt_n else None
    return out


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Several runs in one table: per number of agents and figure, the medians' and the per-turn
    ratios' medians min–max over runs, and the widest per-turn range."""
    lines = ["| agents | figure | llama-server (ms) | ours (ms) | ours / llama-server, per turn: median (min–max) |",
             "|---|---|---|---|---|"]
    for agents in runs[0]["summary"]:
        for figure in FIGURES:
            cells = [r["summary"][agents][figure] for r in runs]
            ls = min_max_text([c["llama-server"]["median"] for c in cells], ".0f")
            ours = min_max_text([c["ours"]["median"] for c in cells], ".0f")
            ratio = min_max_text([c["ours"]["ratio"] for c in cells], ".3f")
            lo, hi = min(c["ours"]["ratio_min"] for c in cells), max(c["ours"]["ratio_max"] for c in cells)
            widest = f"{lo:.2f}–{hi:.2f}"
            lines.append(f"| {agents} | {FIGURE_NAMES[figure]} | {ls} | {ours} | {ratio} ({widest}) |")
    return "\n".join(lines)


class AgentServers:
    """Ours and llama-server on the agents' argv: ``-c CTX -np SLOTS -t THREADS`` and Qwen 3.5's
    template (the llama-server binary found, or the bench exits)."""

    def __init__(self, model: str, threads: int):
        self.name, self.threads = model, threads
        self.binary, self.model = llama_server_or_exit(), model_set(model).busy

    def starts(self, shared: tuple[str, ...] = ()) -> dict[str, Any]:
        """Each server's start, ``shared`` added to both argvs (for ``servers_running``)."""
        return {k: functools.partial(start, k, str(self.binary), self.model, SLOTS, self.threads, ctx=CTX,
                                     template=("--chat-template-file", str(TEMPLATE)), shared=shared)
                for k in SERVERS}

    def rounds(self, n: int, batch: int | None,
               one: Callable[[str, int, str], Awaitable[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
        """``n`` rounds a server, ``one(base URL, repetition, server)`` each, both up at once and
        the order rotating; ``batch``: both servers get ``-b batch``."""
        shared = () if batch is None else ("-b", str(batch))
        out: dict[str, list[dict[str, Any]]] = {k: [] for k in SERVERS}
        with servers_running(self.starts(shared)) as servers:
            for rep, k in interleaved(n, list(SERVERS)):
                out[k].append(asyncio.run(one(servers[k].base, rep, k)))
        return out

    def described(self) -> dict[str, Any]:
        """What a run's JSON says of the machine and the servers."""
        return {"machine": machine_info(), "model": self.name, "model_file": Path(self.model).name,
                "llama_server_build": build_info(self.binary), "threads": self.threads, "ctx": CTX, "slots": SLOTS,
                "template": str(TEMPLATE.relative_to(ROOT))}


async def our_cache_counters(base: str) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as http:
        return await prompt_cache_metrics(http, base)


def shared_args(mib: int | None, slot_dir: str) -> tuple[str, ...]:
    """``/metrics`` on (ours' prompt-cache counters are read there), and the servers' RAM tier
    and (ours) disk tier, or their defaults."""
    return ("--metrics",) + (() if mib is None else ("--cache-ram", str(mib), "--slot-save-path", slot_dir))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.agent_turns", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-hybrid-wide", help=MODEL_HELP)
    ap.add_argument("--agents", default="1,2", help="conversations at once, one phase each")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cache-ram", type=int, metavar="MIB", help="both servers get --cache-ram MIB and "
                    "--slot-save-path (a temporary directory: ours spills what the RAM tier evicts there)")
    args = parse_against_llama_server(ap, argv)
    if (shown := table_only(args, runs_table)) is not None:
        return shown
    agent_servers = AgentServers(args.model, args.threads)
    samples: dict[str, Any] = {}
    counters: dict[str, list[str]] = {}  # ours' prompt-cache counters after each phase (they add up)
    with tempfile.TemporaryDirectory(prefix="agent-turns-") as slot_dir, \
            servers_running(agent_servers.starts(shared_args(args.cache_ram, slot_dir))) as servers:
        bases = {k: srv.base for k, srv in servers.items()}
        for agents in (int(a) for a in args.agents.split(",")):
            samples[str(agents)] = asyncio.run(measure(bases, agents, args.turns, args.max_tokens))
            counters[str(agents)] = asyncio.run(our_cache_counters(bases["ours"]))
    result = {**agent_servers.described(), "turns": args.turns, "max_tokens": args.max_tokens,
              "cache_ram_mib": args.cache_ram, "ours_prompt_cache": counters,
              "summary": {a: summarize_turns(s) for a, s in samples.items()}, "samples": samples}
    return report_run(args.out, result, runs_table)


if __name__ == "__main__":
    main()

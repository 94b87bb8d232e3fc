"""bindings-floor: how much of ours' distance to llama-server is the library's, in any process.

    python -m tools.bench.bindings_floor --model gemma-270m [--rounds 8] [--out FILE] [--table DIR]

Three take turns on the servers' argv (``-c 8192 -np 4 -t THREADS``; both servers up, each
idle while another works): llama-server, a **bare process** on the same bindings and ours. The
bare process is ``engine.llama_backend`` alone — the model loaded with the servers' context
(``n_batch`` 2048, each slot's KV cache its own, as ``-np 4`` gives both), the same
``llama_decode`` calls, no server and no client — a fresh one each round (a ``bare-prompt``
worker of :mod:`tools.bench.workers`). Each round, each of the three:

1. a cold document of ~1,700 tokens that no one has seen (a number of its own in front): its
   prompt's time, the servers' ``timings.prompt_ms`` and the bare process's decodes, in the
   chunks the servers use (where a model has a sliding window or a recurrent state they stop
   ``4 + n_ubatch`` and 4 tokens before the end for their checkpoints);
2. one 200-token greedy stream: tok/s from its first token to its last — the chunks as the
   client reads them, the bare process's samples.

Every figure is given over llama-server's in the same round. A bare process level with
llama-server and ours behind both says the server's path costs it; a bare process behind
llama-server says the library does, in whatever process loads it (docs/performance.md, "Gemma
on the AMD EPYC host: what is the library's and what is the server's").
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
from typing import Any

import aiohttp

from tools.bench.common import (MODEL_HELP, interleaved, machine_info, min_max_text,
                                parse_against_llama_server, report_run, table_only)
from tools.bench.llama_server import build_info, llama_server_or_exit, servers_running
from tools.bench.models import model_set
from tools.bench.openai_workload import post_json, stream
from tools.bench.procs import run_worker
from tools.bench.vs_llama_server import CTX, start

SLOTS, N_BATCH, TOKENS = 4, 2048, 200
WHO = ("llama-server", "bare", "ours")
FIGURES = {"prompt_ms": "cold document, prompt ms", "tok_s": f"one {TOKENS}-token stream, tok/s"}
STREAM_PROMPT = "The history of the city of Rome begins"
TIMEOUT_S = 600


def document(key: str) -> str:
    """A ~1,700-token document (on Gemma's vocabulary) whose first words no other request shares."""
    body = " ".join(f"Section {i}: the committee reviewed item {i * 7 % 13} and noted its cost of "
                    f"{i * 31 % 97} units." for i in range(80))
    return f"Document {key}. {body}"


def chunk_ends(n: int, checkpoints: bool, n_batch: int, n_ubatch: int) -> list[int]:
    """Where the servers end their decodes of an ``n``-token prompt: ``n_batch`` at a time, and
    where they take checkpoints (a sliding window or a recurrent state) also ``4 + n_ubatch``
    and 4 tokens before the end."""
    ends = set(range(n_batch, n, n_batch)) | {n}
    if checkpoints:
        ends |= {e for e in (n - 4 - n_ubatch, n - 4) if e > 0}
    return sorted(ends)


async def bare(model: str, key: str, threads: int) -> dict[str, Any]:
    """The bare process's round (a ``bare-prompt`` worker of :mod:`tools.bench.workers`)."""
    params = {"model": model, "n_ctx": CTX, "n_seq_max": SLOTS, "n_batch": N_BATCH, "n_threads": threads,
              "document": document(key), "prompt": STREAM_PROMPT, "n_predict": TOKENS}
    out = await run_worker("bare-prompt", params, timeout=TIMEOUT_S)
    return {k: out[k] for k in ("prompt_ms", "prompt_n", "tok_s")}


async def served(base: str, key: str) -> dict[str, Any]:
    """A server's round: the document's prompt (one token generated), then the stream."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http:
        timings = (await post_json(http, f"{base}/completion", {"prompt": document(key), "n_predict": 1,
                                                                "temperature": 0, "cache_prompt": True}))["timings"]
        s = await stream(http, base, "/v1/completions", {"prompt": STREAM_PROMPT, "max_tokens": TOKENS,
                                                         "ignore_eos": True})
    return {"prompt_ms": timings["prompt_ms"], "prompt_n": timings["prompt_n"], "tok_s": s["decode_tok_s"]}


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per figure: each one's median, and bare and ours over llama-server round by round."""
    out: dict[str, Any] = {}
    for fig in FIGURES:
        cell: dict[str, Any] = {w: statistics.median(r[w][fig] for r in rounds) for w in WHO}
        for w in ("bare", "ours"):
            q = [r[w][fig] / r["llama-server"][fig] for r in rounds]
            cell[f"{w}_ratio"] = {"median": statistics.median(q), "min": min(q), "max": max(q)}
        out[fig] = cell
    return out


def runs_table(runs: list[dict[str, Any]]) -> str:
    lines = ["| figure | rounds | llama-server | bare process | ours | bare / llama-server, per round "
             "| ours / llama-server, per round |", "|---|---|---|---|---|---|---|"]
    for fig, name in FIGURES.items():
        cells = [r["summary"][fig] for r in runs]
        vals = [min_max_text([c[w] for c in cells], ".1f") for w in WHO]
        qs = [f"{min_max_text([c[f'{w}_ratio']['median'] for c in cells], '.3f')} "
              f"({min(c[f'{w}_ratio']['min'] for c in cells):.3f}–{max(c[f'{w}_ratio']['max'] for c in cells):.3f})"
              for w in ("bare", "ours")]
        lines.append(f"| {name} | {min_max_text([r['rounds'] for r in runs], 'd')} | {' | '.join(vals)} | "
                     f"{' | '.join(qs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.bindings_floor", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-270m", help=MODEL_HELP)
    ap.add_argument("--rounds", type=int, default=8)
    args = parse_against_llama_server(ap, argv)
    if (shown := table_only(args, runs_table)) is not None:
        return shown
    binary, model = llama_server_or_exit(), model_set(args.model).busy
    starts = {w: functools.partial(start, w, str(binary), model, SLOTS, args.threads) for w in ("llama-server", "ours")}
    rounds: list[dict[str, dict[str, Any]]] = [{} for _ in range(args.rounds)]
    with servers_running(starts) as servers:
        for w in starts:  # the first request of each server loads its pages: not a round's
            asyncio.run(served(servers[w].base, f"warm-{w}"))
        for rnd, w in interleaved(args.rounds, list(WHO)):
            print(f"bindings-floor: round {rnd + 1}/{args.rounds}, {w}", file=sys.stderr, flush=True)
            key = f"{rnd}-{w}"
            rounds[rnd][w] = asyncio.run(bare(model, key, args.threads) if w == "bare" else
                                         served(servers[w].base, key))
    result = {"machine": machine_info(), "model": args.model, "llama_server_build": build_info(binary),
              "threads": args.threads, "ctx": CTX, "slots": SLOTS, "rounds": args.rounds,
              "summary": summarize(rounds), "samples": rounds}
    return report_run(args.out, result, runs_table)


if __name__ == "__main__":
    main()

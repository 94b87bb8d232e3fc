"""A short request's time to first token against the idle time before it: ours and llama-server.

    python -m tools.bench.ttft_gaps [--model tiny] [--gaps 0,1,2,5,10,20] [--requests 25]
                                    [--rounds 4] [--against TREE] [--out FILE]
    python -m tools.bench.ttft_gaps --table DIR     # the runs DIR/run-N.json in one table

The vs-llama-server scenario's short requests alternate between the two servers, so each
server meets every request after a millisecond or two of idleness. This measures how the first
token depends on that idle time. Three servers are up at once on the same llama-server argv
(``-c 8192 -np 4 -t THREADS``, as in :mod:`tools.bench.vs_llama_server`): llama-server, ours,
ours with ``--loop-priority normal`` (the event loop at the normal policy instead of SCHED_RR),
and a floor: :mod:`tools.bench.bare_completion`, the least a Python server on the same
bindings does for the same answer. ``--against TREE`` adds ours from another checkout (``ours at
COMMIT``): a change measured before and after in one run. For each gap, each round gives
each server a block of ``--requests`` requests, each one after ``gap`` ms of sleep: a new
connection, a streamed 4-token ``/v1/completions`` of a short distinct prompt, timed from
before ``connect`` until the first event with a token.
The block starts with one request that is not counted, and the servers' order rotates every
round. The client is a blocking socket, so no client framework's own time lies on the
measured path. It runs on the same cores as the servers, as the bench's own client does.

Reports, per gap and server, the median, 10th and 90th percentile (ms) and the ratio of the
medians to llama-server's: the medians and ratios as a Markdown table, everything (and every
sample) in the JSON that ``--out`` writes.
"""
from __future__ import annotations

import argparse
import functools
import json
from itertools import groupby
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from tools.bench.common import (MODEL_HELP, git_commit, interleaved, machine_info, min_max_text,
                                p10_median_p90, parse_against_llama_server, report_run, table_only)
from tools.bench.llama_server import OpenAIServer, build_info, llama_server_or_exit, servers_running
from tools.bench.models import model_set
from tools.bench.vs_llama_server import start
from tools.bench.vs_llama_server_figures import FLOOR

SERVERS = {"llama-server": ("llama-server", ()), "ours": ("ours", ()),
           "ours, loop normal": ("ours", ("--loop-priority", "normal"))}
MAX_TOKENS = 4
READ_TIMEOUT_S = 30.0


def bare_server(model: str, threads: int) -> OpenAIServer:
    """:mod:`tools.bench.bare_completion` on the shared argv (it reads what it needs of it)."""
    return start(FLOOR, "", model, 4, threads)


def first_token_ms(port: int, prompt: str) -> float:
    """One streamed completion on a new connection: ms from before ``connect`` to the first
    event that carries a token; the rest of the stream is read and the connection closed."""
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(head + body)
        seen = b""
        while b'"choices"' not in seen:
            data = s.recv(65536)
            if not data:
                raise RuntimeError(f"the stream ended before a token: {seen[:200]!r}")
            seen += data
        t1 = time.perf_counter()
        while s.recv(65536):
            pass
    return (t1 - t0) * 1000


def _block(port: int, gap_s: float, n: int, first: int) -> list[float]:
    first_token_ms(port, f"A list of rivers, number {first}:")  # not counted: the block's start
    out = []
    for i in range(n):
        if gap_s:
            time.sleep(gap_s)
        out.append(first_token_ms(port, f"A list of rivers, number {first + 1 + i}:"))
    return out


def measure(ports: dict[str, int], gaps_ms: list[float], n: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """{gap: {server: [ms, ...]}}; the servers' order rotates every round."""
    names = list(ports)
    samples: dict[str, dict[str, list[float]]] = {str(g): {k: [] for k in names} for g in gaps_ms}
    prompt = 0
    for _, round_order in groupby(interleaved(rounds, names), key=lambda pair: pair[0]):
        order = [k for _, k in round_order]
        for g in gaps_ms:
            for k in order:
                samples[str(g)][k] += _block(ports[k], g / 1000, n, prompt)
                prompt += n + 1
    return samples


def summarize_gaps(samples: dict[str, dict[str, list[float]]], base: str = "llama-server") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gap, by_server in samples.items():
        ref = statistics.median(by_server[base])
        out[gap] = {k: {**p10_median_p90(v, 3), "n": len(v), "ratio": round(statistics.median(v) / ref, 3)}
                    for k, v in by_server.items()}
    return out


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Several runs' summaries in one table: per gap and server, the medians' and ratios' min–max."""
    first = runs[0]["summary"]
    names = list(dict.fromkeys(k for r in runs for k in next(iter(r["summary"].values()))))
    gaps = [g for g in first if all(g in r["summary"] for r in runs)]  # runs may differ in --gaps
    lines = ["| idle before each request | " + " | ".join(f"{k} (ms{'' if k == 'llama-server' else '; ratio'})"
                                                         for k in names) + " |", "|---|" + "---|" * len(names)]
    for gap in gaps:
        cells = []
        for k in names:
            if not all(k in r["summary"][gap] for r in runs):  # an older run without this server
                cells.append("—")
                continue
            cell = min_max_text([r["summary"][gap][k]["median"] for r in runs], ".2f")
            if k != "llama-server":
                cell += f"; {min_max_text([r['summary'][gap][k]['ratio'] for r in runs], '.2f')}×"
            cells.append(cell)
        lines.append(f"| {float(gap):g} ms | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.ttft_gaps", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help=MODEL_HELP)
    ap.add_argument("--gaps", default="0,1,2,5,10,20", help="ms of idle time before each request")
    ap.add_argument("--requests", type=int, default=25, help="counted requests per block")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--against", type=Path, help="another checkout of this project: its server too")
    args = parse_against_llama_server(ap, argv)
    if (shown := table_only(args, runs_table)) is not None:
        return shown
    binary = llama_server_or_exit()
    model = model_set(args.model).busy
    gaps = [float(g) for g in args.gaps.split(",")]
    starts: dict[str, Callable[[], OpenAIServer]] = {
        k: functools.partial(start, variant, str(binary), model, 4, args.threads, adds)
        for k, (variant, adds) in SERVERS.items()}
    starts[FLOOR] = functools.partial(bare_server, model, args.threads)
    if args.against is not None:
        tree = args.against.resolve()
        starts[f"ours at {git_commit(tree, mark_dirty=False)}"] = functools.partial(
            start, "ours", str(binary), model, 4, args.threads, root=tree)
    with servers_running(starts) as servers:
        samples = measure({k: srv.port for k, srv in servers.items()}, gaps, args.requests, args.rounds)
    summary = summarize_gaps(samples)
    result = {"machine": machine_info(),
              "model": args.model, "model_file": Path(model).name, "llama_server_build": build_info(binary),
              "threads": args.threads, "max_tokens": MAX_TOKENS, "requests_per_block": args.requests,
              "rounds": args.rounds, "servers": {k: list(adds) for k, (_, adds) in SERVERS.items()},
              "summary": summary, "samples": samples}
    return report_run(args.out, result, runs_table)


if __name__ == "__main__":
    main()

"""Where four streams' CPU goes, function by function: ours beside llama-server, by ``perf``.

    python -m tools.bench.perf_breakdown [--model tiny-hybrid-wide] [--rounds 2] [--seconds 6] [--out FILE]
    python -m tools.bench.perf_breakdown --table DIR   # the runs DIR/run-N.json in one table

Each round starts each server on a fresh process on the shared argv of ``vs-llama-server``
(``-c 8192 -np 4 -t THREADS``; the order rotates round by round) and gives it that bench's
round up to its four streams: a warm-up, one stream of 200 tokens, two short requests, four
short ones started in reverse order (the stories of its second round on: ``FIRST_ROUND``).
Then four streams of 200 tokens start together and, ``SETTLE_S`` later (every stream
decoding), ``perf record -F 499 -p PID -- sleep SECONDS`` samples the whole server; ``perf
report --sort dso,sym`` of it is summed into kinds of work (:data:`KINDS`), what no kind names
into "other". Needs ``perf`` (linux-perf) and ``perf_event_paranoid`` ≤ 2; without it the bench
says so and measures nothing.

The wheel's ``libggml-cpu`` hides most of its internal symbols: a sample there without a
name is counted as a matrix product (on the models measured, its hot unnamed loops are
tinyBLAS's fused multiply-adds; llama-server's own binary names them).
"""
from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import statistics
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from tools.bench.common import (MODEL_HELP, interleaved, min_max_text, now, parse_against_llama_server, report_run,
                                table_only)
from tools.bench.openai_workload import aggregate, concurrent, round_history
from tools.spawn import cpu_used

SERVERS = ("llama-server", "hydra")
SETTLE_S = 1.5  # from the four streams' start to the first sample: every stream past its prompt
PERF_HZ = 499
MAX_TOKENS = 200  # each stream's, as vs-llama-server's rounds
#: rounds take vs-llama-server's stories from its second round on: in its first, two of the four
#: end after a few tokens on tiny-hybrid-wide, and perf would sample two streams
FIRST_ROUND = 2
#: kinds of work, in the order a symbol is tried; (name, pattern over "library symbol")
KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("state copies (memmove, get_rows, concat, cpy)",
     re.compile(r"memmove|memcpy|get_rows|concat|dup_bytes|forward_cpy|set_rows")),
    ("matrix products (tinyBLAS, vec_dot, mul_mat)", re.compile(r"tinyBLAS|vec_dot|gemm|mul_mat|^libggml-cpu\S* 0x")),
    ("recurrent ops (delta net, conv, scan)", re.compile(r"gated_delta_net|ssm_conv|ssm_scan|rwkv")),
    ("attention", re.compile(r"flash_attn|soft_max")),
    ("OpenMP waits (libgomp)", re.compile(r"^libgomp")),
    ("Python", re.compile(r"^libpython|^python")),
    ("kernel", re.compile(r"^\[kernel")),
)
OTHER = "other"
_ROW = re.compile(r"\s+([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)")


def kinds(report: str) -> dict[str, float]:
    """``perf report --stdio --sort dso,sym`` text summed into :data:`KINDS` (percent of samples)."""
    acc: Counter[str] = Counter()
    for line in report.splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        key = f"{m.group(2)} {m.group(3).strip()}"
        acc[next((name for name, rx in KINDS if rx.search(key)), OTHER)] += float(m.group(1))
    return {name: round(acc[name], 2) for name in [*(k for k, _ in KINDS), OTHER]}


def perf_missing() -> str | None:
    """Why ``perf`` cannot sample a process here, or None."""
    if shutil.which("perf") is None:
        return "perf is not installed (linux-perf)"
    done = subprocess.run(["perf", "record", "-q", "-o", "/dev/null", "--", "true"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"perf record failed: {done.stderr.strip()[:200]}"


async def sample(pid: int, seconds: float, folder: Path) -> dict[str, float]:
    """``perf`` over the process ``pid`` for ``seconds``, its samples summed into :func:`kinds`."""
    data = folder / f"perf-{pid}.data"
    rec = await asyncio.create_subprocess_exec("perf", "record", "-q", "-F", str(PERF_HZ), "-p", str(pid), "-o",
                                               str(data), "--", "sleep", str(seconds),
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    await rec.wait()
    rep = await asyncio.create_subprocess_exec("perf", "report", "-i", str(data), "--stdio", "--sort", "dso,sym",
                                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    text, _ = await rep.communicate()
    return kinds(text.decode(errors="replace"))


async def one_round(http: Any, srv: Any, base_n: int, seconds: float, folder: Path) -> dict[str, Any]:
    """The vs-llama-server round's history, then four streams with ``perf`` over them."""
    await round_history(http, srv.base, base_n, MAX_TOKENS)
    before, t0 = srv.thread_cpu(), now()
    four = asyncio.ensure_future(concurrent(http, srv.base, list(range(base_n + 10, base_n + 14)), MAX_TOKENS))
    await asyncio.sleep(SETTLE_S)
    shares = await sample(srv.pid, seconds, folder)
    runs = await four
    after, wall = srv.thread_cpu(), now() - t0
    tokens = sum(r["chunks"] for r in runs)
    return {"four_tok_s": round(aggregate(runs) or 0.0, 2),
            "cpu_ms_per_token": round(1000 * cpu_used(before, after) / tokens, 2),
            "wall_s": round(wall, 2), "stream_tokens": [r["completion_tokens"] for r in runs], "kinds": shares}


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Each kind's share of the samples, per server: median (min–max) over every round of the runs."""
    rounds = {k: [r for run in runs for r in run["rounds"][k]] for k in SERVERS}
    lines = ["| kind of work: share of the server's samples | llama-server | ours |", "|---|---|---|"]

    def cell(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} ({min_max_text(values, fmt)})"

    for name in [*(k for k, _ in KINDS), OTHER]:
        lines.append(f"| {name} | " + " | ".join(cell([r["kinds"][name] for r in rounds[k]], ".1f") + " %"
                                                  for k in SERVERS) + " |")
    for key, label in (("four_tok_s", "four streams, aggregate tok/s"), ("cpu_ms_per_token", "CPU per token, ms")):
        lines.append(f"| {label} | " + " | ".join(cell([r[key] for r in rounds[k]], ".1f") for k in SERVERS) + " |")
    return "\n".join(lines)


async def measure(model: str, threads: int, n_rounds: int, seconds: float) -> dict[str, list[dict[str, Any]]]:
    from tools.bench.llama_server import find_or_build
    from tools.bench.vs_llama_server import start

    binary, reason = await asyncio.to_thread(find_or_build, False)
    if binary is None:
        raise SystemExit(f"no llama-server: {reason}")
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in SERVERS}
    timeout = aiohttp.ClientTimeout(total=900)
    with tempfile.TemporaryDirectory(prefix="hydra-perf-") as tmp:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as http:
            for rnd, variant in interleaved(n_rounds, list(SERVERS)):
                with start(variant, str(binary), model, 4, threads) as srv:
                    rounds[variant].append(await one_round(http, srv, 100 * (rnd + FIRST_ROUND), seconds, Path(tmp)))
    return rounds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.perf_breakdown", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-hybrid-wide", help=MODEL_HELP)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per server, the order rotating")
    ap.add_argument("--seconds", type=float, default=6.0, help="how long perf samples the four streams")
    args = parse_against_llama_server(ap, argv)
    if (shown := table_only(args, runs_table)) is not None:
        return shown
    if (why := perf_missing()) is not None:
        raise SystemExit(f"perf_breakdown: {why}")
    from engine.model_files import resolve_model

    rounds = asyncio.run(measure(str(resolve_model(args.model)), args.threads, args.rounds, args.seconds))
    result = {"model": args.model, "threads": args.threads, "perf_hz": PERF_HZ, "seconds": args.seconds,
              "settle_s": SETTLE_S, "first_round": FIRST_ROUND, "rounds": rounds}
    return report_run(args.out, result, runs_table)


if __name__ == "__main__":
    main()

"""The RAM tier's lookup and save over many agents' conversations: this checkout beside
another revision, in one run.

    python -m tools.bench.ram_tier_lookup [--against REV] [--rounds 5] [--out FILE]
    python -m tools.bench.ram_tier_lookup --table DIR     # the runs DIR/run-N.json in one table

A fleet node's RAM tier (llama-server's ``--cache-ram``) fills with the states its agents'
conversations left in the slots. Every request's admission asks every entry for the longest
prefix it could load (``HostCache.best``), and every state saved walks them for entries it
covers (``HostCache.put``), on the inference thread while every slot waits. The prompts here
are agents': a system prompt of ``SYSTEM_TOKENS`` that all share, then each conversation's own
turns (200–3,000 tokens) and the template's last turn, alike in all; each entry carries two
checkpoints (600 and 4 tokens before its end), as a recurrent model's do.

For each number of entries (``ENTRIES``) and memory kind (recurrent, as the fleet's model, or
full attention): the median time of a lookup for a new conversation (``best_us``) and of a
save (``put_us``). ``--against REV`` takes ``engine/`` of that revision (``git archive``) and
measures it the same way; the two alternate round by round, each round in a fresh process.
No model: the bookkeeping alone.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.bench.common import add_run_args, machine_info, min_max_text, table_only, write_run
from tools.spawn import ROOT

SYSTEM_TOKENS = 3000
ENTRIES = (50, 200, 800)
LOOKUPS = 60  # per round, kind and size; the round's figure is their median
SAVES = 30
KINDS = ("recurrent", "attention")


def conversation(i: int) -> list[int]:
    r = random.Random(i)
    own = [r.randrange(50_000) for _ in range(r.randrange(200, 3000))]
    return list(range(SYSTEM_TOKENS)) + own + [7, 8, 9]


def measure(entries: tuple[int, ...] = ENTRIES, lookups: int = LOOKUPS, saves: int = SAVES) -> dict[str, Any]:
    """One round in this process, with whatever ``engine`` it imports: median µs per kind and size."""
    from engine.checkpoints import Checkpoint
    from engine.host_cache import HostCache

    out: dict[str, Any] = {}
    for kind in KINDS:
        recurrent = kind == "recurrent"
        for n in entries:
            tier = HostCache(limit_bytes=None)
            for i in range(n):
                t = conversation(i)
                tier.put("m", t, b"s", recurrent=recurrent,
                         checkpoints=[Checkpoint(t[:len(t) - 600], b"c"), Checkpoint(t[:len(t) - 4], b"c")])
            target, best = conversation(10**6), []
            for _ in range(lookups):
                t0 = time.perf_counter_ns()
                tier.best("m", target, 0, recurrent, at_least=16)
                best.append((time.perf_counter_ns() - t0) / 1e3)
            put = []
            for j in range(saves):
                t = conversation(2 * 10**6 + j)
                t0 = time.perf_counter_ns()
                tier.put("m", t, b"s", recurrent=recurrent)
                put.append((time.perf_counter_ns() - t0) / 1e3)
            out[f"{kind}/{n}"] = {"best_us": round(statistics.median(best), 1),
                                  "put_us": round(statistics.median(put), 1)}
    return out


def _round(engine_root: Path, entries: tuple[int, ...]) -> dict[str, Any]:
    """One round in a fresh process that imports ``engine`` from ``engine_root``."""
    code = (f"import json, sys; sys.path[:0] = [{str(engine_root)!r}, {str(ROOT)!r}]; "
            f"from tools.bench.ram_tier_lookup import measure; print(json.dumps(measure({entries!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=engine_root, capture_output=True, text=True,
                          check=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(against: str | None, rounds: int, entries: tuple[int, ...] = ENTRIES) -> dict[str, Any]:
    """``rounds`` rounds of this checkout (and of ``against``, alternating)."""
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"this": ROOT}
        if against is not None:
            archive = subprocess.run(["git", "archive", against, "engine"], cwd=ROOT, capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            roots["against"] = Path(tmp)
        per_round = [{label: _round(root, entries) for label, root in roots.items()} for _ in range(rounds)]
    return {"against": against, "rounds": per_round, "system_tokens": SYSTEM_TOKENS}


FIGURES = (("best_us", "a lookup"), ("put_us", "a save"))


def _runs_medians(runs: list[dict[str, Any]], who: str, key: str, fig: str) -> list[float]:
    """Each run's median over its rounds of ``who``'s figure ``fig`` at ``key`` (kind/entries)."""
    return [statistics.median(r[who][key][fig] for r in run["rounds"]) for run in runs]


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Several runs in one table: each kind, size and figure's median over a run's rounds,
    min–max over the runs, and ``against`` over this checkout round by round."""
    first = runs[0]["rounds"][0]["this"]
    rev = runs[0].get("against")
    head = f"| entries | µs, this checkout ({len(runs)} run{'s' if len(runs) > 1 else ''}) |"
    sep = "|---|---|"
    if rev:
        head += f" µs, at {rev} | {rev} / this, per round (min–max) |"
        sep += "---|---|"
    lines = [head, sep]
    for key in first:
        for fig, label in FIGURES:
            this = min_max_text(_runs_medians(runs, "this", key, fig), ".0f")
            row = f"| {key.replace('/', ', ')} entries: {label} | {this} |"
            if rev:
                ratios = [r["against"][key][fig] / r["this"][key][fig] for run in runs for r in run["rounds"]]
                row += (f" {min_max_text(_runs_medians(runs, 'against', key, fig), '.0f')} |"
                        f" {min(ratios):.1f}–{max(ratios):.1f}× |")
            lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.ram_tier_lookup", description=__doc__.split("\n")[0])
    ap.add_argument("--against", metavar="REV", help="a git revision whose engine/ is measured beside this one")
    ap.add_argument("--rounds", type=int, default=5)
    add_run_args(ap)
    args = ap.parse_args(argv)
    if (shown := table_only(args, runs_table)) is not None:
        return shown
    result = {"machine": machine_info(), **run(args.against, args.rounds)}
    print(runs_table([result]))
    write_run(args.out, result)
    return result


if __name__ == "__main__":
    main()

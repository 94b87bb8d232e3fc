"""``hydra-rpc bench [SCENARIO...]``: measure the performance budgets (docs/performance.md).

Each scenario starts its own server process(es) on 127.0.0.1 and drives them from this
process (and worker subprocesses); every candidate figure is reported next to a baseline
measured in the same run. Writes ``OUT/<scenario>.json`` (raw samples + summary),
``OUT/summary.md`` and, with ``--plot``, ``OUT/<scenario>.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path

from hydra_rpc.cli.usage import model_errors

SCENARIOS = {
    "meta-under-decode": "tools.bench.meta_under_decode",
    "decode-overhead": "tools.bench.decode_overhead",
    "slots-scaling": "tools.bench.slots_scaling",
    "reload-stall": "tools.bench.reload_stall",
    "state-transfer": "tools.bench.state_transfer",
    "passthrough": "tools.bench.passthrough",
    "connections": "tools.bench.connections",
    "prompt-cache": "tools.bench.prompt_cache",
    "busy-host": "tools.bench.busy_host",
    "constrained": "tools.bench.constrained",
    "vs-llama-server": "tools.bench.vs_llama_server",
    "reload-soak": "tools.bench.reload_soak",
}
BUSY_WARNING_PCT = 20
DOCS_PAGE = Path("docs/performance.md")
DOCS_IMAGES = Path("docs/performance")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                   help=f"scenarios to run (default: all): {', '.join(SCENARIOS)}")
    p.add_argument("--model", default="tiny",
                   help="tiny (generated models, default), gemma-270m, or a GGUF path")
    p.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    p.add_argument("--plot", action="store_true", help="draw PNG charts (matplotlib)")
    p.add_argument("--quick", action="store_true", help="a few seconds per scenario, one repetition")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default: 3, or 1 with --quick)")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: all usable cores)")
    p.add_argument("--blocking-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="reload-stall: also run a server whose T3 reload blocks its event loop, as the C++ "
                        "engine's does (an emulation in the harness; default: on)")
    p.add_argument("--runs", type=int, default=1, metavar="N",
                   help="run the whole set N times (OUT/run-1 … run-N) and write a combined table with the "
                        "spread over runs (OUT/combined.md)")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 when any budget is missed (in any run)")
    p.add_argument("--docs", action="store_true",
                   help=f"also draw the charts, copy them to {DOCS_IMAGES}/ and the table into {DOCS_PAGE} "
                        "(between its bench:table markers); needs every scenario; run from the repository root")


#: --quick on the tiny models: a scenario that has not finished by then is stuck, not slow
#: (each takes 3-40 s on a 2-core host); the traceback names the await it was stuck in
QUICK_SCENARIO_DEADLINE_S = 150.0


def quick_deadline(quick: bool, model_spec: str) -> float | None:
    """The bound on each scenario: --quick's on the tiny models, which it is sized for. A heavier
    model (tiny-hybrid-wide, Gemma) takes minutes where they take seconds, and a bound there
    would call a slow scenario stuck; its scenarios' own deadlines still apply."""
    from .models import TINY_SETS

    return QUICK_SCENARIO_DEADLINE_S if quick and model_spec in TINY_SETS else None


async def _bounded(coro, deadline: float | None, name: str):
    if deadline is None:
        return await coro
    try:
        return await asyncio.wait_for(coro, deadline)
    except TimeoutError as e:
        from .common import BenchError

        raise BenchError(f"{name} did not finish within {deadline:.0f} s, --quick's bound on the tiny models "
                         "(3-40 s each on a 2-core host): stuck") from e


def _without_out(argv: list[str]) -> list[str]:
    """The command as reports record it: without ``--out`` (a folder of the measuring machine,
    which reports copied to docs/ must not name)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            out.append(a)
    return out


def _run_async(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)
    return uvloop.run(coro)


def run(args: argparse.Namespace) -> int:
    from .common import BenchContext, background_busy, machine_info, usable_cpus
    from .models import model_set
    from .procs import raise_fd_limit
    from .pooled import section as pooled_section
    from .report import combined_table

    names = args.scenarios or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"hydra-rpc bench: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    if args.docs and set(names) != set(SCENARIOS):
        print("hydra-rpc bench: --docs rewrites the whole table, so it needs every scenario", file=sys.stderr)
        return 2
    if args.runs < 1:
        print("hydra-rpc bench: --runs must be at least 1", file=sys.stderr)
        return 2
    raise_fd_limit(4096)  # 1,000+ sockets in the connections scenario; servers inherit the limit
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with model_errors():  # a bad --model is one line, before anything else is printed
        models = model_set(args.model)
    ctx = BenchContext(quick=args.quick, models=models, reps=args.reps or (1 if args.quick else 3),
                       threads=args.threads or usable_cpus(), blocking_baseline=args.blocking_baseline,
                       http=importlib.util.find_spec("hydra_rpc.http.app") is not None)
    command = "hydra-rpc bench " + shlex.join(_without_out(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]))
    runs: list[list] = []
    for i in range(args.runs):
        run_out = out / f"run-{i + 1}" if args.runs > 1 else out
        run_out.mkdir(parents=True, exist_ok=True)
        machine = machine_info()
        machine["background"] = background_busy(1.0)
        busy = machine["background"].get("cpu_busy_pct") or 0
        if busy > BUSY_WARNING_PCT:
            print(f"hydra-rpc bench: warning: the host is {busy:.0f} % busy before the run; other processes will "
                  "disturb the figures", file=sys.stderr, flush=True)
        if args.runs > 1:
            print(f"hydra-rpc bench: run {i + 1} of {args.runs} → {run_out}/", file=sys.stderr, flush=True)
        runs.append(_run_once(names, ctx, machine, run_out, command, args))
    if args.runs > 1:
        text = combined_table(runs)
        pooled = pooled_section(runs)  # vs-llama-server's pairs over all the runs
        text += f"\n\n{pooled}" if pooled else ""
        (out / "combined.md").write_text(f"# hydra-rpc benchmark: {args.runs} runs\n\n`{command}`\n\n{text}\n")
        print(text)
        print(f"\n{args.runs} runs in {out}/run-*/; combined table in {out}/combined.md")
    if args.docs:
        _to_docs(runs, out, args.runs)
    missed = [f"{res.scenario}: {r.metric}" for rs in runs for res in rs for r in res.rows if r.ok is False]
    if args.fail_on_miss and missed:
        print(f"hydra-rpc bench: {len(missed)} budget row(s) missed:\n  " + "\n  ".join(missed), file=sys.stderr)
        return 1
    return 1 if any(r.error for rs in runs for r in rs) else 0


def _run_once(names: list[str], ctx, machine: dict, out: Path, command: str, args: argparse.Namespace) -> list:
    from .common import Result, load_between, load_now
    from .report import markdown, table

    results: list[Result] = []
    for name in names:
        mod = importlib.import_module(SCENARIOS[name])
        print(f"hydra-rpc bench: {name} …", file=sys.stderr, flush=True)
        before, t0 = load_now(), time.monotonic()
        try:
            res = _run_async(_bounded(mod.run(ctx), quick_deadline(args.quick, args.model), name))
        except Exception as e:
            traceback.print_exc()
            res = Result(name, error=f"{type(e).__name__}: {e}")
        res.machine = {**machine, **load_between(before, load_now()), "duration_s": round(time.monotonic() - t0, 1)}
        res.config = {"model_spec": args.model, "quick": args.quick, "threads": ctx.threads, **res.config}
        res.write(out)
        results.append(res)
        print(f"hydra-rpc bench: {name} done in {res.machine['duration_s']} s"
              + (f" — FAILED: {res.error}" if res.error else ""), file=sys.stderr, flush=True)
    plots: list[Path] = []
    if args.plot or args.docs:
        from .plots import draw_all

        plots = draw_all(results, out)
    (out / "summary.md").write_text(markdown(results, machine, command, ctx.models.describe(), plots))
    print(table(results))
    print(f"\nresults in {out}/ (summary.md, <scenario>.json{', <scenario>.png' if plots else ''})")
    return results


def _to_docs(runs: list[list], out: Path, n: int) -> None:
    """Charts, summaries and each run's raw results (``<scenario>.json``, the table's source)
    to docs/performance/ (one folder per run with --runs), the table (combined over the runs
    with --runs) into docs/performance.md."""
    from .report import combined_table, replace_table, table, write_docs_json

    dirs = [(out / f"run-{i + 1}", DOCS_IMAGES / f"run-{i + 1}", runs[i]) for i in range(n)] if n > 1 else []
    # the last run's charts are the page's; its JSON there only when it is the one run
    dirs.append((dirs[-1][0] if dirs else out, DOCS_IMAGES, [] if dirs else runs[-1]))
    for src, dst, results in dirs:
        dst.mkdir(parents=True, exist_ok=True)
        for f in [*src.glob("*.png"), src / "summary.md"]:
            if f.is_file():
                shutil.copy2(f, dst / f.name)
        for stale in dst.glob("*.json"):  # the folder holds this run's results only
            stale.unlink()
        for res in results:
            if (src / f"{res.scenario}.json").is_file():
                write_docs_json(src / f"{res.scenario}.json", dst / f"{res.scenario}.json")
    text = combined_table(runs) if n > 1 else table(runs[-1])
    if not DOCS_PAGE.is_file() or not replace_table(DOCS_PAGE, text):
        print(f"hydra-rpc bench: {DOCS_PAGE} has no bench:table markers; table not copied", file=sys.stderr)

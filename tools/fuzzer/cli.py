"""``hydra-rpc fuzz``: fuzz a Hydra port (or a ggml-RPC passthrough, or the codec in-process).

    hydra-rpc fuzz --target 127.0.0.1:9503 --seconds 60 --seed 1 --out findings/
    hydra-rpc fuzz --target 127.0.0.1:0 --spawn 'hydra-rpc serve --model tiny --port {port} --no-http'
    hydra-rpc fuzz --replay findings/desync-op.sweep-s1-i40.json
    hydra-rpc fuzz --codec --cases 20000
    hydra-rpc fuzz --protocol ggml --target 127.0.0.1:9503 --i-know-upstream-may-crash

Every run writes OUT/results.json (also when nothing was found): the findings, the cases
run per phase and generator, and whether a phase was cut short by --seconds/--cases.

Exit status: 0 nothing found (replay: the case no longer fails), 1 findings (replay: it
still fails), 2 usage or target errors, 130 interrupted (results.json still written).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
from pathlib import Path

from hydra_rpc.cli.usage import UsageError

from .execute import RunConfig
from .progress import Progress, summary_table
from .case_files import replay
from .runner import Options, Runner
from .target import Target, TargetError, is_loopback, parse_hostport


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    t = p.add_argument_group("target")
    t.add_argument("--target", metavar="HOST:PORT", help="the port to fuzz (loopback only unless --allow-remote); "
                                                         "port 0 with --spawn picks a free one")
    t.add_argument("--allow-remote", action="store_true", help="allow a target that is not a loopback address")
    t.add_argument("--spawn", metavar="CMD", help="start the target with CMD ({port} is replaced), restart it "
                                                  "after crashes and record how it died")
    t.add_argument("--protocol", choices=["hydra", "ggml"], default="hydra",
                   help="ggml: malformed ggml-RPC through a passthrough (needs --i-know-upstream-may-crash)")
    t.add_argument("--i-know-upstream-may-crash", action="store_true",
                   help="confirm that --protocol ggml may crash the upstream rpc-server behind the target")
    t.add_argument("--codec", action="store_true", help="fuzz the codec's decoders in-process (no target)")
    r = p.add_argument_group("run")
    r.add_argument("--seconds", type=float, help="stop generating cases after this long (default 60 unless --cases "
                                                 "is given); confirmed findings are minimized after that")
    r.add_argument("--cases", type=int, help="stop after this many cases")
    r.add_argument("--seed", type=int, help="case sequence seed (default: random, printed)")
    r.add_argument("--start", type=int, default=0, help="first case index")
    r.add_argument("--index", type=int, action="append", help="run only this case index (repeatable)")
    r.add_argument("--deadline", type=float, default=2.0,
                   help="seconds a reply, a close or a liveness INFO may take (default 2)")
    r.add_argument("--slots", type=int, default=2, help="slot ids the cases may use: 0..N-1 (default 2)")
    r.add_argument("--max-rss-growth", type=int, default=1024, metavar="MB",
                   help="with --spawn: a jump of the target's peak RSS above this in one case is a finding")
    r.add_argument("--slow-senders", type=int, default=0, metavar="N",
                   help="keep N connections dribbling a request at one byte a second while the cases run; one the "
                        "target has not closed after --slow-deadline seconds is a finding (default 0: off)")
    r.add_argument("--slow-deadline", type=float, default=120.0, metavar="S",
                   help="seconds a dribbling connection may stay open (default 120)")
    r.add_argument("--list", action="store_true", help="print the cases (index, phase, generator, digest) and exit")
    o = p.add_argument_group("findings")
    o.add_argument("--out", type=Path, default=Path("fuzz-findings"),
                   help="where case files, results.json and target.log go (default fuzz-findings)")
    o.add_argument("--no-minimize", action="store_true", help="save findings as found")
    o.add_argument("--minimize-seconds", type=float, default=30.0, help="minimization budget per finding")
    o.add_argument("--replay", type=Path, metavar="CASE",
                   help="run one saved case again (against its recorded target/spawn unless --target is given)")
    o.add_argument("--json", action="store_true", help="print the results as JSON on stdout (for CI)")
    o.add_argument("--progress", choices=["auto", "bar", "plain", "none"], default="auto",
                   help="live progress on stderr: a bar, a line every few seconds, or nothing; auto: a bar on "
                        "a terminal")


def _progress(args: argparse.Namespace, total_cases: int | None, total_seconds: float | None) -> Progress:
    tty = {"bar": True, "plain": False}.get(args.progress)
    return Progress(sys.stderr, total_cases=total_cases, total_seconds=total_seconds, tty=tty,
                    quiet=args.progress == "none")


LIVE_TARGET_WARNING = ("hydra-rpc fuzz: warning: {address} is a live server, not one started with --spawn: the "
                       "CONFIGURE, SWAP_QUANT and STATE_PUT cases change its settings, model and slots, and they "
                       "stay changed after the run. Fuzz a throwaway copy with --target HOST:0 --spawn CMD.")


def _target(args: argparse.Namespace, fallback: str | None = None, spawn: str | None = None) -> Target:
    spec = args.target or fallback
    if not spec:
        raise UsageError("--target HOST:PORT is required (or --codec, which needs no target)")
    try:
        host, port = parse_hostport(spec)
    except ValueError as e:
        raise UsageError(f"{e}; e.g. --target 127.0.0.1:9503") from None
    if not args.allow_remote and not is_loopback(host):
        raise UsageError(f"{host} is not a loopback address; fuzzing it needs --allow-remote")
    spawn = args.spawn or spawn
    if port == 0 and not spawn:
        raise UsageError("port 0 needs --spawn (the fuzzer then picks a free port)")
    return Target(host, port, spawn, None if args.codec else args.out)


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 130


async def _main(args: argparse.Namespace) -> int:
    if args.replay is not None:
        return await _replay(args)
    protocol = "codec" if args.codec else args.protocol
    if protocol == "ggml" and not args.i_know_upstream_may_crash:
        raise UsageError("--protocol ggml sends malformed ggml-RPC through the passthrough to the upstream "
                         "rpc-server, which is known to crash on bad input (docs/ggml.md). Add "
                         "--i-know-upstream-may-crash to go ahead.")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    seconds = args.seconds if args.seconds is not None or args.cases is not None or args.index else 60.0
    if args.list:
        return _list(args, seed, protocol)
    cfg = RunConfig(deadline=args.deadline, slots=args.slots, max_rss_growth_mb=args.max_rss_growth)
    opts = Options(seed=seed, cases=args.cases, seconds=seconds, start=args.start, only=args.index,
                   protocol=protocol, out=args.out, minimize=not args.no_minimize,
                   minimize_seconds=args.minimize_seconds, cfg=cfg, slow_senders=args.slow_senders,
                   slow_deadline=args.slow_deadline)
    target = None if protocol == "codec" else _target(args)
    progress = _progress(args, args.cases or (len(args.index) if args.index else None), seconds)
    results = await _run_interruptible(Runner(opts, target, progress), target, protocol)
    return _write_results(args, results)


def dump_tasks(file=None) -> None:
    """SIGUSR1: where every task of the run waits, innermost await last, on stderr — what a run
    that seems stuck is waiting for (a suspended task's own stack shows only its outer frame)."""
    file = file or sys.stderr
    for task in asyncio.all_tasks():
        print(f"task {task.get_name()}:", file=file)
        coro = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                print(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=file)
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    file.flush()


async def _run_interruptible(runner: Runner, target: Target | None, protocol: str) -> dict:
    """The runner's results; a SIGINT stops it with what was run so far (``runner.interrupted()``)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_sigint() -> None:
        runner.stop_requested = True
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    except (NotImplementedError, RuntimeError):
        pass
    # A SIGINT before our handler went to asyncio.run's, which only cancels this task.
    runner.stop_requested = task.cancelling() > 0
    if target is not None and not target.spawn and protocol == "hydra":
        print(LIVE_TARGET_WARNING.format(address=target.address), file=sys.stderr, flush=True)
    try:
        if target is not None:
            await target.start()
        results = await runner.run()
    except TargetError as e:
        raise UsageError(str(e)) from e
    except (OSError, TimeoutError) as e:
        raise UsageError(f"cannot reach the target {target.address if target else ''}: {e or type(e).__name__}; "
                         "is it running?") from e
    except asyncio.CancelledError:
        results = runner.interrupted()
    finally:
        try:
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGUSR1)
        except (NotImplementedError, RuntimeError):
            pass
        if target is not None:
            await target.close()
    return results


def _write_results(args: argparse.Namespace, results: dict) -> int:
    """OUT/results.json, the summary (and --json the results) printed; the exit status."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = summary_table(results)
    if args.json:
        print(json.dumps(results, indent=2))
        print(table, file=sys.stderr)
    else:
        print(table)
    if results.get("stopped_early"):
        print(f"stopped early: {results['stopped_early']}", file=sys.stderr)
    if results["coverage"]["stopped_by"] == "interrupted":
        return 130
    return 1 if results["findings"] else 0


def _list(args: argparse.Namespace, seed: int, protocol: str) -> int:
    from .runner import case_source
    from .schedule import GenSettings

    source = case_source(protocol, GenSettings(slots=args.slots))
    indexes = args.index or range(args.start, args.start + (args.cases or 100))
    for i in indexes:
        c = source(seed, i)
        print(f"{seed}/{i}\t{c.phase}\t{c.generator}\t{c.digest()}\t{c.size}\t{c.note[:100]}")
    return 0


async def _replay(args: argparse.Namespace) -> int:
    try:
        doc = json.loads(args.replay.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the case file {args.replay}: {e}") from None
    protocol = doc.get("case", {}).get("protocol", "hydra")
    target = None
    scratch = None
    if protocol != "codec":
        recorded = doc.get("target")
        spawn = None if args.target else doc.get("spawn")  # an explicit --target is used as it is
        if spawn and "{port}" in spawn and recorded:
            recorded = recorded.rsplit(":", 1)[0] + ":0"  # a fresh free port for the spawned copy
        args.codec = False
        target = _target(args, recorded, spawn)
        # A replay leaves the run's target.log alone: the spawned copy logs to a scratch
        # directory (read by the traceback oracle, removed afterwards).
        scratch = tempfile.TemporaryDirectory(prefix="hydra-fuzz-replay-")
        target.log_dir = Path(scratch.name)
    cfg = RunConfig(deadline=args.deadline, slots=args.slots) if args.deadline != 2.0 else None
    try:
        if target is not None:
            await target.start()
        code, report = await replay(args.replay, target, cfg)
    except TargetError as e:
        raise UsageError(str(e)) from e
    except (OSError, TimeoutError) as e:
        raise UsageError(f"cannot reach the target: {e or type(e).__name__}; is it running?") from e
    finally:
        if target is not None:
            await target.close()
        if scratch is not None:
            scratch.cleanup()
    if args.json:
        print(json.dumps(report, indent=2))
    return code

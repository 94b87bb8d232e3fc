"""What every scenario shares: the run context, statistics, results and machine facts.

Statistical hygiene, once for all scenarios: each scenario warms up before it records,
repeats its measurement ``ctx.reps`` times with baseline and candidate *interleaved*
(A B A B …, so slow drift of the machine hits both alike), and reports medians with
their spread (min–max over repetitions) next to pooled percentiles. The CPU count and
the load average before and after each scenario go into its JSON.
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .models import ModelSet

now = time.perf_counter  # every client-side timestamp of the harness uses this one clock


class BenchError(RuntimeError):
    """A scenario could not measure what it should (server refused, process died, …)."""


@dataclass
class BenchContext:
    quick: bool
    models: ModelSet
    reps: int
    threads: int  # compute threads for servers and baselines (all usable cores)
    blocking_baseline: bool = False
    http: bool = False  # whether this server build has its HTTP side (DECODE v3 results)

    def pick(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full


# ---------------------------------------------------------------- statistics
def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in 0..100; None when empty."""
    v = sorted(values)
    if not v:
        return None
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def summarize(values: Iterable[float]) -> dict[str, Any]:
    """n, min, p50, p90, p99, max, mean of a sample (e.g. latencies in ms)."""
    v = sorted(values)
    if not v:
        return {"n": 0}
    return {"n": len(v), "min": _r(v[0]), "p50": _r(percentile(v, 50)), "p90": _r(percentile(v, 90)),
            "p99": _r(percentile(v, 99)), "max": _r(v[-1]), "mean": _r(sum(v) / len(v))}


def spread(values: Iterable[float | None]) -> dict[str, Any]:
    """Median and min–max of per-repetition values (Nones, i.e. failed repetitions, dropped)."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": _r(percentile(v, 50)), "min": _r(v[0]), "max": _r(v[-1]), "n": len(v)}


def decode_prompt(model: Any, seq: int, tokens: list[int], pos0: int = 0) -> None:
    """``tokens`` into sequence ``seq`` from position ``pos0``, in chunks of the model's
    ``n_batch`` (one ``llama_decode`` takes no more), the last token's logits kept for sampling."""
    from engine.backend import BatchItem

    nb = model.n_batch
    for at in range(0, len(tokens), nb):
        model.decode([BatchItem(seq, tokens[at:at + nb], pos0 + at, at + nb >= len(tokens))])


def p10_median_p90(values: Iterable[float], digits: int = 1) -> dict[str, float]:
    """A sample's median and 10th/90th percentiles, rounded: what the standalone benches report."""
    v = list(values)
    return {name: round(percentile(v, q), digits) for name, q in (("median", 50), ("p10", 10), ("p90", 90))}


def min_max_text(values: Iterable[float], fmt: str) -> str:
    """``values``' min–max as a table cell shows it: one number when both print alike."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def interleaved(reps: int, variants: list[Any]) -> list[tuple[int, Any]]:
    """(rep, variant) in an order that rotates the variants each repetition (A B C, B C A, …),
    so neither the first nor the last slot of a round always belongs to the same variant."""
    out = []
    for rep in range(reps):
        k = rep % len(variants)
        out += [(rep, v) for v in variants[k:] + variants[:k]]
    return out


# ---------------------------------------------------------------- results
NEAR_BUDGET = 0.10  # a met row this close to its limit (relative) is flagged: it may flip next run


@dataclass
class Row:
    """One line of the summary table: a measured value against its same-run baseline.

    A budget is checked either by the scenario (``ok``) or, given ``limit``, here: the
    ``value`` (``on="value"``) or the ratio to the baseline (``on="ratio"``) must stay below
    the limit (``kind="max"``) or reach it (``kind="min"``). With a limit the row also knows
    whether it passed by less than :data:`NEAR_BUDGET`. ``lo``/``hi`` are the value's
    min–max over the repetitions.
    """

    metric: str
    value: float | None
    unit: str
    baseline: float | None = None
    baseline_label: str = ""
    budget: str = ""  # the docs/performance.md budget this row checks ("" = informational)
    ok: bool | None = None  # None: no budget, or the budget does not apply to this run
    note: str = ""
    lo: float | None = None
    hi: float | None = None
    limit: float | None = None
    on: str = "value"  # value | ratio
    kind: str = "min"  # min: measured ≥ limit; max: measured < limit

    def __post_init__(self) -> None:
        if self.ok is None and self.limit is not None and self.measured is not None:
            m = self.measured
            self.ok = m >= self.limit if self.kind == "min" else m < self.limit

    @property
    def ratio(self) -> float | None:
        return ratio(self.value, self.baseline)

    @property
    def measured(self) -> float | None:
        """What the limit applies to."""
        return self.ratio if self.on == "ratio" else self.value

    @property
    def near(self) -> bool:
        """Met, but by less than NEAR_BUDGET of the limit."""
        m = self.measured
        if not self.ok or self.limit is None or m is None or not self.limit:
            return False
        return abs(m - self.limit) <= NEAR_BUDGET * abs(self.limit)

    def with_spread(self, sp: dict[str, Any]) -> "Row":
        """Take ``lo``/``hi`` from a :func:`spread` of the value over repetitions."""
        self.lo, self.hi = sp.get("min"), sp.get("max")
        return self

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = _r(self.ratio)
        d["near"] = self.near
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Row":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class Result:
    scenario: str
    config: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "error": self.error, "machine": self.machine, "config": self.config,
                "summary": self.summary, "rows": [r.as_dict() for r in self.rows], "notes": self.notes,
                "samples": self.samples}

    def write(self, out: Path) -> Path:
        path = out / f"{self.scenario}.json"
        path.write_text(result_json(self.as_dict()))
        return path


def result_json(result: dict[str, Any]) -> str:
    """A result as committed next to the docs: indented, the home directory as ``~``."""
    return home_as_tilde(json.dumps(result, indent=1, default=_json_default)) + "\n"


def load_runs(folder: Path) -> list[dict[str, Any]]:
    """A standalone bench's runs, ``folder/run-N.json``, in order of N."""
    paths = sorted(folder.glob("run-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(p.read_text()) for p in paths]


def add_run_args(ap: Any) -> None:
    """A standalone bench's ``--out FILE`` and ``--table DIR`` (an ``argparse`` parser)."""
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, metavar="DIR", help="print the table of the runs DIR/run-N.json and exit")


MODEL_HELP = "tiny (tiny-small), tiny-hybrid, tiny-hybrid-wide (the fleet model's recurrent state), tiny-moe or gemma-270m"


def parse_against_llama_server(ap: Any, argv: list[str] | None) -> Any:
    """The parsed command line of a standalone bench against llama-server: ``ap``'s own
    arguments, then ``--threads`` and the run arguments (``add_run_args``)."""
    ap.add_argument("--threads", type=int, default=2)
    add_run_args(ap)
    return ap.parse_args(argv)


def table_only(args: Any, runs_table: Any) -> dict[str, Any] | None:
    """``--table DIR``: print ``runs_table`` of its runs and say how many; None without it."""
    if args.table is None:
        return None
    runs = load_runs(args.table)
    print(runs_table(runs))
    return {"runs": len(runs)}


def write_run(out: Path | None, result: dict[str, Any]) -> None:
    """A standalone bench's ``--out``: the run's JSON (nothing without ``out``)."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(result_json(result))


def report_run(out: Path | None, result: dict[str, Any], runs_table: Any) -> dict[str, Any]:
    """A standalone bench's run done: its table printed, its JSON written (``--out``), and returned."""
    print(runs_table([result]))
    write_run(out, result)
    return result


def home_as_tilde(text: str, home: str | None = None) -> str:
    """JSON ``text`` with every string that starts in the home directory starting at ``~``
    instead: results are committed next to the docs, and a machine's paths do not belong there
    (``~/.cache/hydra-rpc/models/…`` still says which model and which build ran)."""
    home = (home or str(Path.home())).rstrip("/")
    if len(home) <= 1:
        return text
    return text.replace(json.dumps(home + "/")[:-1], '"~/')


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def rounded(values: Iterable[float], nd: int = 4) -> list[float]:
    """Raw samples as JSON-friendly rounded floats (sub-microsecond digits are noise)."""
    return [round(x, nd) for x in values]


# ---------------------------------------------------------------- machine facts
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def git_commit(tree: Path = Path(__file__).resolve().parent, *, mark_dirty: bool = True) -> str:
    """The short commit ``tree`` (this checkout by default) is at, ``+dirty`` after it when the
    tree has changes and ``mark_dirty``; "" outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=tree)
        dirty = mark_dirty and subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                                              timeout=5, cwd=tree).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    """Facts that decide how the numbers should be read (recorded once per run)."""
    try:
        import llama_cpp

        llama_version = llama_cpp.__version__
    except Exception:  # pragma: no cover - the server would not start either
        llama_version = ""
    try:
        mem = next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
        mem_mib = int(mem) // 1024
    except (OSError, StopIteration):
        mem_mib = None
    return {"cpu_count": os.cpu_count(), "cpus_usable": usable_cpus(), "cpu_model": _cpu_model(),
            "mem_total_mib": mem_mib, "platform": platform.platform(), "python": sys.version.split()[0],
            "llama_cpp_python": llama_version, "git_commit": git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _cpu_times() -> list[int]:
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return []


def _own_cpu_seconds() -> float:
    """CPU time of this process and of its children that have been waited for (every server
    and worker of a scenario is stopped and reaped before the scenario ends)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def load_now() -> dict[str, Any]:
    """The load average and the CPU time counters, to be compared by :func:`load_between`."""
    la = os.getloadavg()
    return {"loadavg_1m": round(la[0], 2), "loadavg_5m": round(la[1], 2), "_cpu": _cpu_times(),
            "_own": _own_cpu_seconds()}


def load_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """How busy the whole machine was in between, how much of that was *other* processes
    (the noise: the server's nice-19 inference thread yields to them), and how much time the
    hypervisor stole."""
    out = {"loadavg_1m_before": before["loadavg_1m"], "loadavg_1m_after": after["loadavg_1m"]}
    a, b = before.get("_cpu") or [], after.get("_cpu") or []
    if len(a) >= 8 and len(b) >= 8:
        d = [y - x for x, y in zip(a, b)]
        total = sum(d[:8]) or 1
        idle = d[3] + d[4]  # idle + iowait
        out.update(cpu_busy_pct=round(100 * (total - idle) / total, 1), cpu_steal_pct=round(100 * d[7] / total, 1))
        if "_own" in before and "_own" in after:
            ticks = os.sysconf("SC_CLK_TCK")
            own = (after["_own"] - before["_own"]) * ticks
            out["cpu_other_processes_pct"] = round(max(0.0, 100 * (total - idle - own) / total), 1)
    return out


def background_busy(seconds: float = 1.0) -> dict[str, Any]:
    """How busy the machine is while this benchmark runs nothing (sampled for ``seconds``).

    The benchmark shares the host: a busy host makes every figure noisy, and the server's
    low-priority inference thread yields to it by design, so this goes into every JSON.
    """
    a = load_now()
    time.sleep(seconds)
    return load_between(a, load_now())

"""vs-llama-server's alternating pairs and ``/slots`` answers, pooled over several runs.

One run has four pairs per figure: a ratio's min–max over them says little about a difference
of 1 %. Pooled over the runs of a set, each paired figure gets the median of every per-pair
ratio with a 95 % bootstrap interval, beside the same for the control (llama-server against a
second llama-server process, ``vs_llama_server_figures``), and a rank-sum permutation test of
whether ours and the control's ratios could be one distribution. A figure whose interval holds
1.0 is level with llama-server as far as these pairs can tell; a figure like the control is one
this host does not tell apart from llama-server against itself. ``/slots`` p99 is taken over
every round's answers together, a few hundred per run instead of one round's hundred or two.

The interval is the spread of the pairs, not of the processes: a run's pairs share two server
processes, so a set of runs can sit off another set of the same code on the same host by
more than either interval (docs/performance.md, "At 2269a8d").

At parity a run's median pair lands on either side of 1.0, so a budget of "≥ 1.0×, three runs
out of three" is met by chance one set in eight; :func:`run_verdicts` counts the runs that meet
each paired figure's budget beside how many the control would: llama-server against itself.

``python -m tools.bench.pooled DIR_OR_JSON ...`` reads the runs a bench wrote (``run-*/``) or
their committed copies (``docs/performance/vs-llama-server-*/run-*.json``) and prints both
tables; ``hydra-rpc bench vs-llama-server --runs N`` adds the pooled one to ``combined.md``.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from .common import percentile
from .vs_llama_server_figures import BUDGETS, CONTROL, LABEL, NAME as SCENARIO, OURS, PAIRED, SLOTS, meets

RESAMPLES = 4000
SEED = 0  # fixed, so that the same runs always give the same intervals and p-values


@dataclass(frozen=True)
class Interval:
    """A pooled ratio (the median of per-pair ratios, or of two p99s) and its 95 % bootstrap
    interval, from ``n`` pairs or answers."""
    n: int
    value: float
    low: float
    high: float

    @classmethod
    def of(cls, n: int, value: float, resampled: list[float]) -> Interval:
        boot = sorted(resampled)
        return cls(n, value, boot[int(0.025 * len(boot))], boot[min(len(boot) - 1, int(0.975 * len(boot)))])

    def text(self) -> str:
        return f"{self.value:.3f} ({self.low:.3f}–{self.high:.3f})"


@dataclass(frozen=True)
class PooledFigure:
    label: str
    lower_is_better: bool
    ours: Interval
    control: Interval | None = None
    p_like_control: float | None = None  # p_same(ours, control)
    samples: str = ""  # what ``ours.n`` counts, when not pairs

    @property
    def verdict(self) -> str:
        """ahead / behind when ours' interval lies wholly on one side of 1.0, else level."""
        below, above = self.ours.high < 1.0, self.ours.low > 1.0
        ahead, behind = (below, above) if self.lower_is_better else (above, below)
        return "ahead" if ahead else "behind" if behind else "level"


def pair_ratios(pairs: Iterable[dict[str, Any]], side: str) -> list[float]:
    """``side``'s value over llama-server's, pair by pair (pairs where either failed left out)."""
    return [p[side] / p[LABEL] for p in pairs if p.get(side) and p.get(LABEL)]


def median_interval(values: Sequence[float], rng: random.Random, resamples: int = RESAMPLES) -> Interval:
    return Interval.of(len(values), statistics.median(values),
                       [statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)])


def p_same(a: Sequence[float], b: Sequence[float], rng: random.Random, resamples: int = RESAMPLES) -> float:
    """How often a random relabelling of both samples puts ranks as far from even as ``a``
    and ``b`` have them (a two-sided rank-sum test by permutation): small when the two are
    unlikely to be one distribution."""
    ranks = _ranks(list(a) + list(b))
    k, even = len(a), len(a) * (len(ranks) + 1) / 2
    seen = abs(sum(ranks[:k]) - even)
    hits = 0
    for _ in range(resamples):
        rng.shuffle(ranks)
        hits += abs(sum(ranks[:k]) - even) >= seen - 1e-9
    return hits / resamples


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pool(runs: Sequence[dict[str, Any]]) -> list[PooledFigure]:
    """Every paired figure over the ``samples`` of several runs (figures with no pairs left
    out), then ``/slots`` p99 over every round's answers."""
    rng = random.Random(SEED)
    out = []
    for key, (_, label, unit, _) in PAIRED:
        ours = [q for s in runs for q in pair_ratios(s.get("pairs", {}).get(key, ()), OURS)]
        if not ours:
            continue
        theirs = [q for s in runs for q in pair_ratios(s.get("control", {}).get(key, ()), CONTROL)]
        out.append(PooledFigure(label, unit == "ms", median_interval(ours, rng),
                                median_interval(theirs, rng) if theirs else None,
                                p_same(ours, theirs, rng) if theirs else None))
    slots = slots_p99(runs, rng)
    return out + ([slots] if slots else [])


def slots_p99(runs: Sequence[dict[str, Any]], rng: random.Random, resamples: int = RESAMPLES
              ) -> PooledFigure | None:
    """``/slots`` p99 while four streams decode, over all the rounds' answers: a round has
    100–200 of them, so its p99 is its second-slowest answer or so, and the rounds' ratios
    mostly measure that. The interval resamples both sides' answers."""
    def answers(variant: str) -> list[float]:
        return [x for s in runs for r in s.get("rounds", ()) if r.get("variant") == variant
                for x in r.get("slots_ms") or ()]

    ours, theirs = answers(OURS), answers(LABEL)
    if not ours or not theirs:
        return None

    def p99_ratio(a: Sequence[float], b: Sequence[float]) -> float:
        return percentile(a, 99) / max(percentile(b, 99), 1e-9)

    interval = Interval.of(len(ours), p99_ratio(ours, theirs),
                           [p99_ratio(rng.choices(ours, k=len(ours)), rng.choices(theirs, k=len(theirs)))
                            for _ in range(resamples)])
    return PooledFigure(f"/slots p99 while {SLOTS} streams decode, over every round's answers", True, interval,
                        samples=f"{len(ours)} and {len(theirs)} answers")


@dataclass(frozen=True)
class RunVerdicts:
    """A paired figure's budget judged run by run, as a run's row judges it (the median of
    ours' values over the median of llama-server's), and the same for the control: how often
    llama-server meets the budget against a second llama-server on the same host."""
    label: str
    budget_key: str  # of vs_llama_server_figures.BUDGETS
    ours: tuple[float, ...]
    control: tuple[float, ...]

    @property
    def budget(self) -> str:
        return BUDGETS[self.budget_key][0]

    def met(self, ratios: Sequence[float]) -> str:
        n = sum(meets(q, self.budget_key) for q in ratios)
        return f"{n}/{len(ratios)} ({', '.join(f'{q:.3f}' for q in ratios)})" if ratios else "—"


def run_verdicts(runs: Sequence[dict[str, Any]]) -> list[RunVerdicts]:
    """Every paired figure's per-run ratio of medians, ours and the control's (runs without
    its pairs left out)."""
    def per_run(group: str, side: str, key: str) -> tuple[float, ...]:
        out = []
        for s in runs:
            pairs = [p for p in s.get(group, {}).get(key, ()) if p.get(side) and p.get(LABEL)]
            if pairs:
                ours, theirs = statistics.median(p[side] for p in pairs), statistics.median(p[LABEL] for p in pairs)
                out.append(ours / theirs)
        return tuple(out)

    out = []
    for key, (_, label, _, budget_key) in PAIRED:
        ours = per_run("pairs", OURS, key)
        if ours:
            out.append(RunVerdicts(label, budget_key, ours, per_run("control", CONTROL, key)))
    return out


def run_verdicts_markdown(verdicts: Sequence[RunVerdicts]) -> str:
    lines = ["Run by run: how many runs meet each paired figure's budget (the median of a run's pairs, ours "
             "over llama-server's), and how many the control would (a second llama-server over llama-server, "
             "the same pairs of the same runs).", "",
             "| figure | budget | ours: runs that meet it | the control: runs that would |", "|---|---|---|---|"]
    lines += [f"| {v.label} | {v.budget} | {v.met(v.ours)} | {v.met(v.control)} |" for v in verdicts]
    return "\n".join(lines)


def markdown(figures: Sequence[PooledFigure], n_runs: int) -> str:
    lines = [f"Pooled over {n_runs} run(s): each alternating pair's ratio to llama-server, their median with "
             "its 95 % bootstrap interval (for /slots, the p99 of every answer); the control is llama-server "
             "against a second llama-server; p: how likely ours and the control's ratios are one distribution "
             "(rank-sum permutation test).", "",
             "| figure | pairs or answers | ours / llama-server | verdict | control | p (like the control) |",
             "|---|---|---|---|---|---|"]
    for f in figures:
        control = f.control.text() if f.control else "—"
        p = f"{f.p_like_control:.2f}" if f.p_like_control is not None else "—"
        better = "lower is better" if f.lower_is_better else "higher is better"
        lines.append(f"| {f.label} ({better}) | {f.samples or f.ours.n} | {f.ours.text()} | {f.verdict} | {control} "
                     f"| {p} |")
    return "\n".join(lines)


def section(runs: Sequence[Sequence[Any]]) -> str:
    """The pooled table for ``combined.md`` from the bench's results (``Result`` lists), or ""
    when no run has vs-llama-server's pairs."""
    samples = [res.samples for results in runs for res in results if res.scenario == SCENARIO and not res.error]
    figures = pool(samples)
    return f"## {SCENARIO}: the pairs pooled\n\n{markdown(figures, len(samples))}\n" if figures else ""


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The ``samples`` of every vs-llama-server result in ``paths`` (files, or folders searched
    for ``vs-llama-server.json`` and ``run-*.json``), in path order."""
    files: list[Path] = []
    for p in paths:
        files += sorted([*p.rglob(f"{SCENARIO}.json"), *p.glob("run-*.json")]) if p.is_dir() else [p]
    out = []
    for f in files:
        data = json.loads(f.read_text())
        if data.get("scenario") == SCENARIO and not data.get("error"):
            out.append(data.get("samples", {}))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    samples = load(Path(a) for a in args)
    figures = pool(samples)
    if not figures:
        print(f"pooled: no {SCENARIO} pairs in {' '.join(args)}", file=sys.stderr)
        return 1
    print(markdown(figures, len(samples)))
    print()
    print(run_verdicts_markdown(run_verdicts(samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

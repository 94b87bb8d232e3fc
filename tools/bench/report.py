"""The markdown summary: one table of every scenario's rows, and the machine it ran on."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .common import NEAR_BUDGET, Result, Row

TABLE_START = "<!-- bench:table:start -->"
TABLE_END = "<!-- bench:table:end -->"


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "—"
    a = abs(x)
    s = f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 0.1 else f"{x:.3f}"
    return f"{s} {unit}".strip()


def _verdict(r: Row) -> str:
    if not r.budget:
        return ""
    v = {True: "✅ met", False: "❌ **missed**", None: "n/a"}[r.ok]
    return v + (f" (within {NEAR_BUDGET:.0%} of the budget)" if r.near else "")


def _value(r: Row) -> str:
    """The value, and its min–max over the repetitions when they differ."""
    v = _num(r.value, r.unit)
    if r.lo is not None and r.hi is not None and r.hi != r.lo:
        v += f" ({_num(r.lo)}–{_num(r.hi)})"
    return v


NOISY_PCT = 25  # other processes' share of all CPUs above which a scenario's figures are flagged


def table(results: list[Result]) -> str:
    lines = ["| scenario | metric | value (min–max over repetitions) | baseline (same run) | ratio | budget | verdict |",
             "|---|---|---|---|---|---|---|"]
    for res in results:
        if res.error:
            lines.append(f"| {res.scenario} | **failed**: {res.error.splitlines()[0][:150]} | | | | | |")
            continue
        other = res.machine.get("cpu_other_processes_pct") or 0
        noisy = f" ⚠ other processes used {other:.0f} % of the CPUs" if other > NOISY_PCT else ""
        for r in res.rows:
            base = f"{_num(r.baseline, r.unit)} ({r.baseline_label})" if r.baseline is not None else "—"
            ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "—"
            metric = r.metric + (f" — {r.note}" if r.note else "")
            lines.append(f"| {res.scenario} | {metric} | {_value(r)} | {base} | {ratio} | "
                         f"{r.budget or '—'} | {_verdict(r)}{noisy if r.budget else ''} |")
    return "\n".join(lines)


def machine_line(machine: dict[str, Any]) -> str:
    bg = machine.get("background") or {}
    return (f"{machine.get('cpus_usable')} usable CPUs ({machine.get('cpu_model')}), "
            f"{machine.get('mem_total_mib')} MiB, Python {machine.get('python')}, "
            f"llama-cpp-python {machine.get('llama_cpp_python')}, commit {machine.get('git_commit') or '?'}, "
            f"{machine.get('date')}; host {bg.get('cpu_busy_pct', '?')} % busy before the run "
            f"(load average {bg.get('loadavg_1m_after', '?')})")


def markdown(results: list[Result], machine: dict[str, Any], command: str, models: dict[str, Any],
             plots: list[Path]) -> str:
    out = ["# hydra-rpc benchmark results\n", f"`{command}`\n", f"Machine: {machine_line(machine)}.\n",
           "Models: " + ", ".join(f"{k} = `{Path(v).name}`" for k, v in models.items()
                                   if k in ("main", "busy", "state", "reload_target")) + ".\n",
           TABLE_START, table(results), TABLE_END, ""]
    notes = [(res.scenario, n) for res in results for n in res.notes]
    if notes:
        out.append("## Notes\n")
        out += [f"- **{s}**: {n}" for s, n in notes]
        out.append("")
    out.append("Host load while each scenario ran (the share of all CPUs; \"other processes\" excludes the "
               "benchmark's own):\n")
    for res in results:
        m = res.machine
        if "duration_s" in m:
            out.append(f"- {res.scenario}: {m['duration_s']} s, CPU {m.get('cpu_busy_pct', '?')} % busy of which "
                       f"{m.get('cpu_other_processes_pct', '?')} % other processes, steal "
                       f"{m.get('cpu_steal_pct', '?')} %, load average {m.get('loadavg_1m_before')} → "
                       f"{m.get('loadavg_1m_after')}")
    if plots:
        out.append("\n## Charts\n")
        out += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(out) + "\n"


def replace_table(doc: Path, table_text: str) -> bool:
    """Swap the table between the markers in ``doc`` for ``table_text``; False if there are no markers."""
    text = doc.read_text()
    a, b = text.find(TABLE_START), text.find(TABLE_END)
    if a < 0 or b < a:
        return False
    doc.write_text(text[:a + len(TABLE_START)] + "\n" + table_text + "\n" + text[b:])
    return True


def combined_table(runs: list[list[Result]]) -> str:
    """One row per (scenario, metric) over several full runs: each run's value and ratio, the
    min–max over runs, and how many runs met the budget (flagged when any run came within
    NEAR_BUDGET of it)."""
    keys: dict[tuple[str, str], list[Row | None]] = {}
    failed: dict[str, list[str]] = {}
    for i, results in enumerate(runs):
        for res in results:
            if res.error:
                failed.setdefault(res.scenario, []).append(f"run {i + 1}: {res.error.splitlines()[0][:120]}")
            for r in res.rows:
                keys.setdefault((res.scenario, r.metric), [None] * len(runs))[i] = r
    n = len(runs)
    head = " | ".join(f"run {i + 1}" for i in range(n))
    lines = [f"| scenario | metric | {head} | min–max | ratio to the same-run baseline (min–max) | budget | verdict |",
             "|---|---|" + "---|" * n + "---|---|---|---|"]
    for (scenario, metric), rows in keys.items():
        present = [r for r in rows if r is not None]
        unit = present[0].unit
        vals = [r.value for r in present if r.value is not None]
        ratios = [r.ratio for r in present if r.ratio is not None]
        cells = " | ".join(_num(r.value) if r is not None else "—" for r in rows)
        span = f"{_num(min(vals))}–{_num(max(vals), unit)}" if vals else "—"
        rspan = f"{min(ratios):.2f}–{max(ratios):.2f}×" if ratios else "—"
        budget = present[0].budget
        verdict = ""
        if budget:
            met = sum(1 for r in present if r.ok)
            judged = sum(1 for r in present if r.ok is not None)
            verdict = f"{'✅' if met == judged == n else '❌'} {met}/{n} met"
            if any(r.near for r in present):
                verdict += f" (a run within {NEAR_BUDGET:.0%} of the budget)"
        lines.append(f"| {scenario} | {metric} | {cells} | {span} | {rspan} | {budget or '—'} | {verdict} |")
    for scenario, errors in failed.items():
        lines.append(f"| {scenario} | **failed** in {'; '.join(errors)} | " + " | " * (n + 3) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- committed artifacts

#: a raw result copied to docs/ larger than this has its sample lists thinned (evenly, first and
#: last kept) until it fits; the summary and rows, which the table is made of, are never touched
DOCS_JSON_MAX_BYTES = 1_000_000


def _thin(samples: Any, keep: int) -> Any:
    if isinstance(samples, dict):
        return {k: _thin(v, keep) for k, v in samples.items()}
    if isinstance(samples, list) and len(samples) > keep:
        step = (len(samples) - 1) / (keep - 1)
        return [_thin(samples[round(i * step)], keep) for i in range(keep)]
    if isinstance(samples, list):
        return [_thin(v, keep) for v in samples]
    return samples


def write_docs_json(src: Path, dst: Path, limit: int = DOCS_JSON_MAX_BYTES) -> Path:
    """Copy one scenario's raw result (``<scenario>.json``: samples, summary, rows, machine,
    config, commit) to ``dst``; past ``limit`` bytes its samples are thinned and the JSON
    says so (``samples_thinned_to``)."""
    text = src.read_text()
    if len(text.encode()) > limit:
        data = json.loads(text)
        keep = 4096
        while keep >= 16:
            data["samples"] = _thin(json.loads(text)["samples"], keep)
            data["samples_thinned_to"] = keep
            text = json.dumps(data, indent=1) + "\n"
            if len(text.encode()) <= limit:
                break
            keep //= 2
    dst.write_text(text)
    return dst


def load_results(folder: Path) -> list[Result]:
    """The results a run wrote (``<scenario>.json``), as :func:`table` and
    :func:`combined_table` take them."""
    out = []
    for path in sorted(folder.glob("*.json")):
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or "rows" not in d or "scenario" not in d:
            continue
        out.append(Result(d["scenario"], config=d.get("config") or {}, summary=d.get("summary") or {},
                          rows=[Row.from_dict(r) for r in d["rows"]], notes=d.get("notes") or [],
                          machine=d.get("machine") or {}, error=d.get("error") or ""))
    return out


def table_block(doc: Path) -> str:
    """The text between the bench:table markers of ``doc`` ("" without them)."""
    text = doc.read_text()
    a, b = text.find(TABLE_START), text.find(TABLE_END)
    return text[a + len(TABLE_START):b].strip() if 0 <= a < b else ""


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numbers_without_artifact(block: str, runs: list[list[Result]]) -> list[str]:
    """Every number in the value columns of a ``combined_table`` block (each run's value, the
    min–max, the ratio span) that the committed results of ``runs`` do not give for that
    row, as "scenario | metric: number". Empty when each figure comes from an artifact."""
    found: dict[tuple[str, str], set[str]] = {}
    for results in runs:
        for res in results:
            for r in res.rows:
                s = found.setdefault((res.scenario, r.metric), set())
                for x in (r.value, r.lo, r.hi):
                    if x is not None:
                        s.add(_num(x))
                if r.ratio is not None:
                    s.add(f"{r.ratio:.2f}")
    missing = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 7 or cells[0] in ("scenario", "") or set(cells[0]) <= {"-"}:
            continue
        scenario, metric, values = cells[0], cells[1], cells[2:-2]  # up to the budget and verdict
        have = found.get((scenario, metric), set())
        for cell in values:
            for n in _NUMBER.findall(cell):
                if n not in have:
                    missing.append(f"{scenario} | {metric}: {n}")
    return missing

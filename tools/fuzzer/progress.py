"""Live progress (a bar on a TTY, plain lines otherwise) and the end-of-run summary table."""
from __future__ import annotations

import sys
import time
from collections import Counter
from typing import IO, Any

from .cases import CLASSES
from .coverage import unfinished_warning


class Progress:
    def __init__(self, stream: IO[str] | None = None, *, total_cases: int | None = None,
                 total_seconds: float | None = None, tty: bool | None = None, interval: float | None = None,
                 quiet: bool = False):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total_cases = total_cases
        self.total_seconds = total_seconds
        # A TTY redraws often; a log file gets a line every few seconds.
        self.interval = interval if interval is not None else (0.2 if self.tty else 5.0)
        self.quiet = quiet
        self.t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def _fraction(self, cases: int) -> float | None:
        parts = []
        if self.total_cases:
            parts.append(cases / self.total_cases)
        if self.total_seconds:
            parts.append((time.monotonic() - self.t0) / self.total_seconds)
        return min(1.0, max(parts)) if parts else None

    def line(self, cases: int, phase: str, findings: Counter, activity: str = "") -> str:
        elapsed = time.monotonic() - self.t0
        rate = cases / elapsed if elapsed > 0 else 0.0
        found = " ".join(f"{c}={findings[c]}" for c in CLASSES if findings.get(c)) or "none"
        text = f"{cases} cases  {rate:6.1f}/s  {elapsed:5.1f}s  phase {phase:<8} findings: {found}"
        if activity:
            text += f"  [{activity}]"
        return text

    def update(self, cases: int, phase: str, findings: Counter, activity: str = "", force: bool = False) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        text = self.line(cases, phase, findings, activity)
        if self.tty:
            frac = self._fraction(cases)
            bar = ""
            if frac is not None:
                n = int(frac * 24)
                bar = f"[{'#' * n}{'-' * (24 - n)}] {frac * 100:3.0f}%  "
            self.stream.write("\r\x1b[2K" + bar + text)
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line that stays (a finding, a restart) — printed above the bar."""
        if self.quiet:
            return
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
            self._drawn = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._drawn and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def summary_table(results: dict[str, Any]) -> str:
    lines = []
    head = (f"hydra-rpc fuzz: {results['cases']} cases in {results['elapsed_s']:.1f}s "
            f"({results['rate']:.1f} cases/s), seed {results['seed']}, target {results.get('target') or '-'}")
    if results.get("total_s", 0) > results["elapsed_s"] + 0.5:
        head += f"; minimizing the findings took {results['total_s'] - results['elapsed_s']:.1f}s more"
    lines.append(head)
    if results.get("restarts"):
        lines += restart_lines(results)
    if results.get("notes"):
        lines.append("notes (not findings): " + ", ".join(f"{k} {v}" for k, v in sorted(results["notes"].items())))
    lines += _coverage_lines(results)
    lines += expected_lines(results)
    findings = results["findings"]
    if not findings:
        cov = results.get("coverage") or {}
        lines.append("No findings in the cases run (see the WARNING above)." if cov.get("unfinished") else
                     "No findings: every oracle held for every case.")
        return "\n".join(lines)
    lines.append(f"findings ({len(findings)}): each with the input that caused it and the oracle it failed")
    for n, f in enumerate(findings, 1):
        size = f"{f['original_bytes']}→{f['minimized_bytes']} bytes" if f.get("minimized_bytes") is not None else ""
        head = (f"{n}. {f['class']}{':' + f['rule'] if f.get('rule') else ''} ×{f['count']} — first case "
                f"{f['seed']}/{f['index']} after {f.get('found_after_s', 0):.1f}s" + (f", {size}" if size else ""))
        lines.append(head)
        lines.append(f"   input:  {f.get('input_line') or f['generator']}")
        lines.append(f"   oracle: {f['class']}: {f.get('detail', '')}")
        if f.get("file"):
            lines.append(f"   case:   {f['file']}  (replay: hydra-rpc fuzz --replay {f['file']})")
    by_class = Counter()
    for f in findings:
        by_class[f["class"]] += f["count"]
    lines.append("by class: " + ", ".join(f"{c} {by_class[c]}" for c in CLASSES if by_class[c]))
    if results.get("flaky"):
        lines.append(f"did not reproduce on re-run (not saved): {results['flaky']}")
    return "\n".join(lines)


def expected_lines(results: dict[str, Any]) -> list[str]:
    """Would-be findings the request itself asked for (a CONFIGURE n_ctx the target accepted)."""
    exp = results.get("expected") or []
    if not exp:
        return []
    n = results.get("expected_count", len(exp))
    out = [f"expected, not findings ({n}): the target did what the request told it to"]
    for e in exp[:5]:
        out.append(f"  case {e['case']}: {e['input']}: {e['detail']}")
    if n > 5:
        out.append(f"  … {n - 5} more in results.json (\"expected\")")
    return out


def _restart_text(r: dict[str, Any]) -> str:
    if r.get("exit"):
        e = r["exit"]
        how = f"it had died ({'killed by ' + e['signal'] if 'signal' in e else 'exit code ' + str(e['returncode'])})"
    elif r.get("stopped"):
        st = r["stopped"]
        code = (f", {'killed by ' + st['signal'] if 'signal' in st else 'exit code ' + str(st['returncode'])}"
                if "returncode" in st else "")
        how = f"still running, stopped by {st['by']}{code}"
    else:
        how = "not running"
    rss = f", peak RSS {r['peak_rss_mib']} MiB" if r.get("peak_rss_mib") is not None else ""
    return f"{r.get('reason', 'restart')}: {how}{rss}"


def restart_lines(results: dict[str, Any], limit: int = 8) -> list[str]:
    """"target restarted N time(s)" and, for each, why: the finding or the death, how the old
    process ended (exit code / signal) and its peak RSS."""
    log = results.get("restart_log") or []
    n = results["restarts"]
    deaths = [e for e in results.get("exits") or []]
    died = ", ".join(sorted({("killed by " + e["signal"]) if "signal" in e else f"exit code {e['returncode']}"
                             for e in deaths}))
    out = [f"target restarted {n} time(s): {len(deaths)} after it died" + (f" ({died})" if died else "")
           + f", {n - len(deaths)} by the fuzzer after a finding or during minimization"]
    for i, r in enumerate(log[:limit], 1):
        out.append(f"  restart {i}: {_restart_text(r)}")
    if len(log) > limit:
        out.append(f"  … {len(log) - limit} more in results.json (\"restart_log\")")
    return out


def _coverage_lines(results: dict[str, Any]) -> list[str]:
    cov = results.get("coverage")
    if not cov:
        return []
    out = ["cases by phase: " + ", ".join(f"{p} {n}" for p, n in cov["by_phase"].items())]
    gens = list(cov["by_generator"].items())
    out.append(f"cases by generator ({len(gens)}): " + ", ".join(f"{g} {n}" for g, n in gens))
    gen = results.get("config_generation") or {}
    if gen.get("before") is not None and gen.get("after") is not None and gen["before"] != gen["after"]:
        out.append(f"the target's config_generation went {gen['before']} → {gen['after']}: its settings were "
                   "changed by the run")
    if cov.get("unfinished"):
        budget = results.get("budget") or {}
        by = cov["stopped_by"]
        limit = (f"--cases {budget.get('cases')}" if by == "cases" else
                 f"--seconds {budget.get('seconds'):g}" if by == "seconds" else "the interrupted run")
        out.append(unfinished_warning(cov, limit))
    return out

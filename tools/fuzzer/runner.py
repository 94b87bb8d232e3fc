"""The run loop: generate case i, run it, judge it; on a finding confirm, minimize, save.

A finding is identified by its signature (class + generator [+ invariant rule]): the first
one of each signature is re-run once ("does it reproduce?"), minimized and written to
``--out`` as a self-contained case file; later ones are only counted (their indexes are
listed, so each stays addressable). With ``--spawn`` the target is restarted after a crash,
hang or liveness failure and before every minimization attempt of those classes, so a
poisoned engine never makes an innocent candidate look guilty.
"""
from __future__ import annotations

import asyncio
import json
import shlex
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .case_files import CONFIRM_GRACE, case_document
from .cases import Case, Failure, Outcome, safe_name, signature
from .coverage import Coverage
from .explain import describe_input, input_line
from .execute import RunConfig, run_case
from .minimize import Minimizer
from .oracles import Baseline, probe_info, take_baseline
from .progress import Progress
from .target import Target, TargetError

KEEP_PRECEDING = 5
KEEP_EXPECTED = 50  # expected (not finding) events kept in results.json
STATE_POISONING = ("crash", "hang", "liveness", "resource")


@dataclass
class Options:
    seed: int = 0
    cases: int | None = None
    seconds: float | None = None
    start: int = 0
    only: list[int] | None = None  # run exactly these indexes
    protocol: str = "hydra"  # hydra | ggml | codec
    out: Path | None = None
    minimize: bool = True
    minimize_seconds: float = 30.0
    minimize_attempts: int = 200
    cfg: RunConfig = field(default_factory=RunConfig)
    replay_cmd: str = "hydra-rpc fuzz --replay"
    slow_senders: int = 0  # background dribblers (tools.fuzzer.slow)
    slow_deadline: float = 120.0


@dataclass
class Finding:
    sig: str
    failure: Failure
    case: Case
    count: int = 1
    indexes: list[int] = field(default_factory=list)
    file: str | None = None
    original_bytes: int = 0
    minimized_bytes: int | None = None
    confirmed: Outcome | None = None  # the re-run that reproduced it (None: could not re-run)
    found_after_s: float = 0.0  # seconds into the run
    preceding: list[int] = field(default_factory=list)  # indexes of the cases run just before it

    def to_json(self) -> dict[str, Any]:
        inp = describe_input(self.case)
        return {"class": self.failure.oracle, "rule": self.failure.rule, "signature": self.sig,
                "input": inp, "input_line": input_line(inp),
                "generator": self.case.generator, "seed": self.case.seed, "index": self.case.index,
                "detail": self.failure.detail, "count": self.count, "indexes": self.indexes[:100],
                "file": self.file, "original_bytes": self.original_bytes, "minimized_bytes": self.minimized_bytes,
                "found_after_s": round(self.found_after_s, 2)}


def case_source(protocol: str, settings):
    if protocol == "codec":
        from .codec_mode import case_at as codec_case_at

        return lambda seed, i: codec_case_at(seed, i)
    if protocol == "ggml":
        from .ggml_mode import case_at as ggml_case_at

        return lambda seed, i: ggml_case_at(seed, i)
    from .schedule import case_at

    return lambda seed, i: case_at(seed, i, settings)


class Runner:
    def __init__(self, opts: Options, target: Target | None, progress: Progress):
        from .schedule import GenSettings

        self.opts = opts
        self.target = target
        self.progress = progress
        self.case_at = case_source(opts.protocol, GenSettings(slots=opts.cfg.slots))
        self.baseline: Baseline | None = None
        self.findings: dict[str, Finding] = {}
        self.by_class: Counter = Counter()
        self.notes: Counter = Counter()
        self.expected: list[dict[str, Any]] = []  # would-be findings the request asked for
        self.expected_count = 0
        self.flaky: Counter = Counter()
        self.cases_run = 0
        self.phase = "-"
        self.stopped_early = ""
        self.stopped_by = ""  # the budget that ended the fuzzing: seconds | cases | interrupted
        self.stop_requested = False  # SIGINT: checked between cases, since a task.cancel() alone can be
        # swallowed by Python 3.11's asyncio.wait_for when the awaited thing finishes at the same moment
        self.coverage = Coverage(opts.protocol, opts.cfg.slots, opts.start)
        self.generations: dict[str, int | None] = {}  # a live target's config_generation before/after
        self.slow_stats: dict[str, Any] | None = None
        self.t0 = time.monotonic()
        # The cases just before the current one: a finding that needs the state they left
        # behind is replayed with them (boofuzz keeps "the N passing cases before a failure").
        self.recent: deque[int] = deque(maxlen=KEEP_PRECEDING)

    # ---------------------------------------------------------------- the loop
    async def run(self) -> dict[str, Any]:
        t0 = self.t0 = time.monotonic()
        if self.opts.protocol == "hydra":
            self.baseline = await take_baseline(self.target, self.opts.cfg.deadline)
            self.generations["before"] = self.baseline.config_generation
        elif self.opts.protocol == "ggml":
            from .ggml_mode import take_ggml_baseline

            self.baseline = await take_ggml_baseline(self.target, self.opts.cfg.deadline)
        slow = None
        if self.opts.slow_senders and self.target is not None and self.opts.protocol == "hydra":
            from .slow import SlowSenders

            slow = SlowSenders(self.target, self.opts.slow_senders, deadline=self.opts.slow_deadline)
            slow.start()
        try:
            await self._cases(t0)
            if slow is not None:
                await slow.settle()
        finally:
            if slow is not None:
                await slow.stop()
                self.slow_stats = slow.stats.to_json()
                if slow.stats.overstayed:
                    self._slow_finding(slow)
        fuzzing = time.monotonic() - t0
        await self._generation_after()
        await self.minimize_all()  # after the case budget: --seconds bounds the fuzzing itself
        self.progress.update(self.cases_run, self.phase, self.by_class, force=True)
        self.progress.close()
        return self.results(fuzzing, time.monotonic() - t0)

    async def _cases(self, t0: float) -> None:
        indexes = iter(self.opts.only) if self.opts.only is not None else _count(self.opts.start)
        for i in indexes:
            if self.stop_requested:
                raise asyncio.CancelledError
            if self.stopped_early:
                break
            if self.opts.cases is not None and self.cases_run >= self.opts.cases:
                self.stopped_by = "cases"
                break
            if self.opts.seconds is not None and time.monotonic() - t0 >= self.opts.seconds:
                self.stopped_by = "seconds"
                break
            case = self.case_at(self.opts.seed, i)
            self.phase = case.phase
            if not await self._target_ready(self._died_after()):
                break
            out = await run_case(case, self.target, self.baseline, self.opts.cfg)
            self.cases_run += 1
            self.coverage.count(case)
            for note in out.notes:
                self.notes[note.split(":")[0]] += 1
            for note in out.expected:
                self._expected(case, note)
            if out.failures:
                await self._on_finding(case, out)
            self.recent.append(i)
            self.progress.update(self.cases_run, self.phase, self.by_class)

    def _slow_finding(self, slow) -> None:
        from .slow import slow_case

        case = slow_case(self.opts.seed, slow.interval)
        longest = max(slow.stats.overstayed)
        failure = Failure("hang", f"{len(slow.stats.overstayed)} connection(s) dribbling a request at one byte every "
                                  f"{slow.interval:g} s stayed open past {slow.deadline:g} s (the longest "
                                  f"{longest:.0f} s): no minimum-rate deadline cut them", "slow-sender")
        out = Outcome(failures=[failure], sent=[m.data for m in case.messages])
        finding = Finding(signature(case, failure), failure, case, count=len(slow.stats.overstayed),
                          original_bytes=case.size, found_after_s=time.monotonic() - self.t0)
        self.findings[finding.sig] = finding
        self.by_class["hang"] += 1
        finding.file = self._write(finding, case, case, out, 0, 0.0,
                                   unconfirmed="seen over a whole run, not re-run or minimized")

    async def _generation_after(self) -> None:
        """A live (not spawned) target keeps what the CONFIGURE cases did to it: say how much."""
        if self.opts.protocol != "hydra" or self.target is None or self.target.spawn:
            return
        try:
            r = await probe_info(self.target, self.opts.cfg.deadline)
        except Exception:  # noqa: BLE001 - a target that stopped answering has its own finding
            return
        self.generations["after"] = r.meta.get("config_generation") if isinstance(r.meta, dict) else None

    def interrupted(self) -> dict[str, Any]:
        """The results of a run stopped by the user: what ran, in the time it really took."""
        self.stopped_by = "interrupted"
        self.progress.close()
        results = self.results(time.monotonic() - self.t0)
        results["stopped_early"] = "interrupted"
        return results

    def _died_after(self) -> str:
        last = self.recent[-1] if self.recent else None
        return (f"it had died after case {self.opts.seed}/{last}" if last is not None
                else "it had died before the first case")

    def _expected(self, case: Case, note: str) -> None:
        self.expected_count += 1
        kind, _, detail = note.partition(": ")
        line = input_line(describe_input(case))
        if len(self.expected) < KEEP_EXPECTED:
            self.expected.append({"kind": kind, "case": f"{case.seed}/{case.index}", "input": line,
                                  "detail": detail})
        self.progress.message(f"[{case.seed}/{case.index}] expected, not a finding ({kind}): {line[:120]}: "
                              f"{detail[:160]}")

    async def _target_ready(self, reason: str = "") -> bool:
        if self.target is None:
            return True
        try:
            if await self.target.ensure_running(reason):
                self.progress.message(f"restarted the target (start #{self.target.starts})")
        except TargetError as e:
            self.stopped_early = f"cannot restart the target: {e}"
            self.progress.message(self.stopped_early)
            return False
        return True

    async def _after_poisoning(self, failure: Failure, case: Case | None = None, what: str = "") -> None:
        """A crash/hang/liveness finding may leave the target unusable: restart or wait for it."""
        if self.target is None or failure.oracle not in STATE_POISONING:
            return
        if self.target.spawn:
            try:
                c = f"{case.seed}/{case.index}" if case is not None else "?"
                await self.target.restart("after " + (what or "a {o} finding in case {c}").format(o=failure.oracle, c=c))
            except TargetError as e:
                self.stopped_early = f"cannot restart the target: {e}"
            return
        if failure.oracle == "crash":  # not ours to restart: give it a moment to come back
            for _ in range(20):
                await asyncio.sleep(0.5)
                try:
                    r, w = await self.target.connect(1.0)
                    w.close()
                    return
                except (OSError, TimeoutError):
                    continue

    # ---------------------------------------------------------------- findings
    async def _on_finding(self, case: Case, out: Outcome) -> None:
        failure = out.primary
        sig = signature(case, failure)
        known = self.findings.get(sig)
        if known is not None:
            known.count += 1
            known.indexes.append(case.index)
            self.by_class[failure.oracle] += 1
            await self._after_poisoning(failure, case, "another {o} (a known signature) in case {c}")
            return
        self.progress.update(self.cases_run, self.phase, self.by_class, activity=f"confirming {sig}", force=True)
        await self._after_poisoning(failure, case)
        if not await self._healthy():
            # The target (or, behind a passthrough, its upstream) did not come back: nothing
            # can be re-run against it. Save what we saw and stop rather than blame every later case.
            self.by_class[failure.oracle] += 1
            finding = Finding(sig, failure, case, indexes=[case.index], original_bytes=case.size,
                              found_after_s=time.monotonic() - self.t0)
            self.findings[sig] = finding
            finding.file = self._write(finding, case, case, out, 0, 0.0,
                                       unconfirmed="not re-run or minimized: the target did not recover after it")
            self.stopped_early = (f"the target stopped answering after case {case.seed}/{case.index} "
                                  f"({failure.oracle}) and did not recover")
            self.progress.message(f"[{case.seed}/{case.index}] FINDING {failure.oracle} via {case.generator} "
                                  f"(not re-run: the target did not recover): {failure.detail[:160]}")
            return
        confirm = await self._rerun(case, failure)
        if confirm is None or not confirm.same_failure(failure):
            self.flaky[sig] += 1
            self.progress.message(f"[{case.seed}/{case.index}] {failure.oracle} did not reproduce on a re-run "
                                  f"({case.generator}): {failure.detail[:120]}")
            await self._after_poisoning(failure, case, "a {o} that did not reproduce, case {c}")
            return
        self.by_class[failure.oracle] += 1
        finding = Finding(sig, failure, case, indexes=[case.index], original_bytes=case.size,
                          confirmed=confirm, found_after_s=time.monotonic() - self.t0, preceding=list(self.recent))
        self.findings[sig] = finding
        self.progress.message(f"[{case.seed}/{case.index}] FINDING {failure.oracle}"
                              f"{':' + failure.rule if failure.rule else ''} via {case.generator}: "
                              f"{failure.detail[:160]}")
        # Saved at once (an interrupted run keeps it); minimized after the run (``minimize_all``).
        finding.file = self._write(finding, case, case, confirm, 0, 0.0)
        await self._after_poisoning(failure, case, "the confirming re-run of case {c} ({o})")

    async def minimize_all(self) -> None:
        """Shrink every confirmed finding, in the order found, and rewrite its case file."""
        for finding in list(self.findings.values()):
            if finding.confirmed is None or not self.opts.minimize or self.stopped_early:
                continue
            case, failure = finding.case, finding.failure
            self.phase = "minimize"
            final_case, final_out, attempts, secs = await self._minimize(case, finding.confirmed, failure, finding.sig)
            if case.program is not None:  # step programs shrink in steps, byte cases in bytes
                finding.original_bytes, finding.minimized_bytes = len(case.program), len(final_case.program or [])
            else:
                finding.original_bytes, finding.minimized_bytes = case.size, final_case.size
            finding.case = final_case
            finding.file = self._write(finding, case, final_case, final_out, attempts, secs)
            await self._after_poisoning(failure, case, "minimizing case {c} ({o})")

    async def _healthy(self, wait: float = 10.0) -> bool:
        """Does the target answer like at the start (for a while, if it is busy recovering)?"""
        if self.target is None or self.baseline is None:
            return True
        deadline = time.monotonic() + wait
        while True:
            try:
                if self.opts.protocol == "ggml":
                    from .ggml_mode import take_ggml_baseline

                    now = await take_ggml_baseline(self.target, self.opts.cfg.deadline)
                    if now.hello_size == self.baseline.hello_size:
                        return True
                else:
                    r = await probe_info(self.target, self.opts.cfg.deadline)
                    if self.baseline.matches(r):
                        return True
            except Exception:  # noqa: BLE001 - any failure means "not yet"
                pass
            if time.monotonic() >= deadline or (self.target.spawn and not self.target.alive):
                return False
            await asyncio.sleep(0.5)

    async def _rerun(self, case: Case, failure: Failure) -> Outcome | None:
        if not await self._target_ready(f"it had died after case {case.seed}/{case.index}, before its re-run"):
            return None
        return await run_case(case, self.target, self.baseline, replace(self.opts.cfg, grace=CONFIRM_GRACE))

    async def _minimize(self, case: Case, out: Outcome, failure: Failure, sig: str):
        if not self.opts.minimize:
            return case, out, 0, 0.0
        last = {"out": out, "dirty": True}

        async def still_fails(cand: Case) -> bool:
            # A hang, liveness or memory failure may leave the engine stuck (a slot that never
            # frees, gigabytes still being zeroed): after a failing attempt, start the next one
            # from a fresh target, or an innocent candidate looks guilty.
            if last["dirty"] and failure.oracle in STATE_POISONING and self.target is not None and self.target.spawn:
                await self.target.restart(f"minimizing {sig}: a fresh target after a failing attempt")
            elif not await self._target_ready(f"it had died during the minimization of {sig}"):
                return False
            if last["dirty"] and not await self._healthy():
                raise TargetError("the target did not recover between minimization attempts")
            self.progress.update(self.cases_run, self.phase, self.by_class, activity=f"minimizing {sig}")
            o = await run_case(cand, self.target, self.baseline, replace(self.opts.cfg, grace=CONFIRM_GRACE))
            last["dirty"] = not o.ok
            if o.same_failure(failure):
                last["out"] = o
                return True
            return False

        t0 = time.monotonic()
        m = Minimizer(still_fails, self.opts.minimize_attempts, self.opts.minimize_seconds)
        try:
            small = await m.run(case)
        except TargetError as e:
            self.stopped_early = str(e)
            small = m.best
        return small, last["out"], m.attempts, time.monotonic() - t0

    def _write(self, finding: Finding, original: Case, case: Case, out: Outcome, attempts: int, secs: float,
               unconfirmed: str = "") -> str | None:
        if self.opts.out is None:
            return None
        self.opts.out.mkdir(parents=True, exist_ok=True)
        name = safe_name(f"{finding.failure.oracle}-{case.generator}-s{case.seed}-i{case.index}") + ".json"
        path = self.opts.out / name
        doc = case_document(case, out, finding.failure, self.target, self.opts, original, attempts, secs)
        doc["input"] = describe_input(case)
        doc["input_line"] = input_line(doc["input"])
        doc["replay"] = f"{self.opts.replay_cmd} {path}"
        if finding.preceding and self.opts.protocol != "codec":
            idx = " ".join(f"--index {i}" for i in [*finding.preceding, original.index])
            where = f"--target {self.target.address}"
            if self.target.spawn:
                where = f"--target {self.target.host}:0 --spawn {shlex.quote(self.target.spawn)}"
            doc["preceding_cases"] = {
                "indexes": finding.preceding,
                "rerun": f"hydra-rpc fuzz {where} --seed {original.seed} {idx}",
                "why": "if the case alone does not reproduce, the state these cases left behind may matter",
            }
        if unconfirmed:
            doc["unconfirmed"] = unconfirmed
        if finding.failure.oracle == "crash" and self.target is not None:
            doc["target_log_tail"] = self.target.log_tail()
        path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        return str(path)

    def results(self, elapsed: float, total: float | None = None) -> dict[str, Any]:
        """``elapsed``: the fuzzing (cases/s is measured on it); ``total`` adds minimization."""
        t = self.target
        return {
            "format": "hydra-rpc-fuzz-results/1", "seed": self.opts.seed, "protocol": self.opts.protocol,
            "target": t.address if t else None, "spawn": t.spawn if t else None, "cases": self.cases_run,
            "elapsed_s": round(elapsed, 3), "total_s": round(elapsed if total is None else total, 3),
            "rate": round(self.cases_run / elapsed, 2) if elapsed else 0.0,
            "findings": [f.to_json() for f in self.findings.values()],
            "by_class": dict(self.by_class), "notes": dict(self.notes), "flaky": dict(self.flaky),
            "restarts": max(0, t.starts - 1) if t and t.spawn else 0, "exits": t.exits if t else [],
            "restart_log": list(t.restarts) if t else [],
            "expected": self.expected, "expected_count": self.expected_count,
            "stopped_early": self.stopped_early,
            "budget": {"seconds": self.opts.seconds, "cases": self.opts.cases},
            "coverage": self.coverage.report(self.stopped_by, self.cases_run / elapsed if elapsed else 0.0),
            "config_generation": self.generations if t and not t.spawn else None,
            "slow_senders": self.slow_stats,
        }


def _count(start: int):
    i = start
    while True:
        yield i
        i += 1

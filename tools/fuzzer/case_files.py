"""A finding as a case file (``--out``), and running one again (``hydra-rpc fuzz --replay``).

A case file is self-contained: the case, what was sent and received, every failure, the
settings it ran with and, once minimized, what it was minimized from.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .cases import CASE_FORMAT, Case, Failure, Outcome
from .execute import RunConfig, run_case
from .explain import describe_input, input_line
from .oracles import take_baseline
from .target import Target

CONFIRM_GRACE = 0.5  # a re-run waits this long for a legal close before the follow-up INFO


def case_document(case: Case, out: Outcome, failure: Failure, target: Target | None, opts: Any,
                  original: Case | None = None, attempts: int = 0, secs: float = 0.0) -> dict[str, Any]:
    """``opts``: the run's ``runner.Options`` (its ``cfg`` and ``protocol`` are recorded)."""
    detail = next((f.detail for f in out.failures if f.oracle == failure.oracle and f.rule == failure.rule),
                  failure.detail)
    doc: dict[str, Any] = {
        "format": CASE_FORMAT,
        "oracle": failure.oracle, "rule": failure.rule, "detail": detail,
        "failures": [f.to_json() for f in out.failures],
        "case": case.to_json(),
        "sent_hex": [m.hex() for m in out.sent],
        "received": out.responses,
        "received_hex": out.received.hex(),
        "exit": out.exit, "notes": out.notes,
        **({"target_traceback": out.traceback} if out.traceback else {}),
        **({"expected": out.expected} if out.expected else {}),
        "target": target.address if target else None,
        "spawn": target.spawn if target else None,
        "settings": {"deadline": opts.cfg.deadline, "slots": opts.cfg.slots, "max_stream": opts.cfg.max_stream,
                     "max_rss_growth_mb": opts.cfg.max_rss_growth_mb, "protocol": opts.protocol},
    }
    if original is not None:
        doc["original"] = {"digest": original.digest(), "bytes": original.size,
                           "messages": len(original.messages), "steps": len(original.program or [])}
        doc["minimized"] = {"attempts": attempts, "seconds": round(secs, 2), "bytes": case.size,
                            "steps": len(case.program or [])}
    return doc


async def replay(path: Path, target: Target | None, cfg: RunConfig | None) -> tuple[int, dict]:
    """Run one saved case again. Returns (exit code, report): 1 if any oracle fails, else 0."""
    doc = json.loads(path.read_text())
    case = Case.from_json(doc["case"])
    settings = doc.get("settings", {})
    cfg = cfg or RunConfig(deadline=settings.get("deadline", 2.0), slots=settings.get("slots", 2),
                           max_stream=settings.get("max_stream", 6.0),
                           max_rss_growth_mb=settings.get("max_rss_growth_mb", 1024))
    cfg = replace(cfg, grace=CONFIRM_GRACE)
    baseline = None
    if case.protocol == "hydra":
        baseline = await take_baseline(target, cfg.deadline)
    elif case.protocol == "ggml":
        from .ggml_mode import take_ggml_baseline

        baseline = await take_ggml_baseline(target, cfg.deadline)
    out = await run_case(case, target, baseline, cfg)
    report = {"case": str(path), "recorded": {"oracle": doc.get("oracle"), "rule": doc.get("rule")},
              "reproduced": out.same_failure(Failure(doc.get("oracle", ""), "", doc.get("rule", ""))),
              "failures": [f.to_json() for f in out.failures], "received": out.responses, "exit": out.exit,
              "notes": out.notes, "expected": out.expected, "input_line": input_line(describe_input(case))}
    if out.traceback:
        report["target_traceback"] = out.traceback
    for note in out.expected:
        print(f"expected, not a finding: {note}", file=sys.stderr)
    # The verdict is the result of a replay, not progress: it is printed whatever --progress says.
    if out.failures:
        p = out.primary
        print(f"REPRODUCED {p.oracle}{':' + p.rule if p.rule else ''}: {p.detail}" if report["reproduced"]
              else f"FAILS differently: {p.oracle}: {p.detail}", file=sys.stderr)
    else:
        print(f"not reproduced: every oracle held (recorded: {doc.get('oracle')})", file=sys.stderr)
    return (1 if out.failures else 0), report

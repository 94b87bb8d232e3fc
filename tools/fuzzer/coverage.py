"""What part of the case schedule a run covered, so a summary never overstates it.

The schedule has phases that end (smoke: every template once; sweep: every mutation family's
variants) before the endless random phase. A run cut short by ``--seconds`` or ``--cases``
inside one of them has not tried every family, and "no findings" then means less than it
says: :class:`Coverage` counts the cases run per phase and per generator and reports the
phase left unfinished, with how many cases (and, at the run's rate, seconds) it still needs.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any

from .cases import Case


def finite_phases(protocol: str, slots: int) -> dict[str, tuple[int, int]]:
    """``phase → (first index, end index)`` for every phase that ends, in schedule order."""
    if protocol == "hydra":
        from .schedule import GenSettings, phase_sizes

        smoke, sweep = phase_sizes(GenSettings(slots=slots))
        return {"smoke": (0, smoke), "sweep": (smoke, smoke + sweep)}
    if protocol == "ggml":
        from .ggml_mode import case_at

        end = next(i for i in itertools.count() if case_at(0, i).phase != "sweep")
        return {"sweep": (0, end)}
    return {}  # codec: one endless round-robin over the decoders


class Coverage:
    def __init__(self, protocol: str, slots: int, start: int = 0):
        self.phases = finite_phases(protocol, slots)
        self.start = start
        self.by_phase: Counter = Counter()
        self.by_generator: Counter = Counter()
        self.next_index: int | None = None

    def count(self, case: Case) -> None:
        self.by_phase[case.phase] += 1
        self.by_generator[case.generator] += 1
        self.next_index = case.index + 1

    def unfinished(self, rate: float) -> dict[str, Any] | None:
        """The finite phase the run stopped inside, or None."""
        if self.next_index is None:
            return None
        last_end = max((end for _, end in self.phases.values()), default=0)
        for phase, (first, end) in self.phases.items():
            if first <= self.next_index < end:
                left = last_end - self.next_index
                return {"phase": phase, "run": self.next_index - max(first, self.start), "size": end - first,
                        "cases_left": left, "seconds_needed": math.ceil(left / rate) if rate > 0 else None}
        return None

    def report(self, stopped_by: str, rate: float) -> dict[str, Any]:
        """``stopped_by``: what ended the run ("seconds", "cases", "interrupted", "" if it ran out of
        explicit --index cases); an explicit case list has no phases to finish."""
        return {"by_phase": dict(self.by_phase), "by_generator": dict(self.by_generator.most_common()),
                "finite_phases": {p: end - first for p, (first, end) in self.phases.items()},
                "stopped_by": stopped_by, "unfinished": self.unfinished(rate) if stopped_by else None}


def unfinished_warning(cov: dict[str, Any], budget: str) -> str:
    """One sentence for the summary: which phase did not finish and what it would take."""
    u = cov["unfinished"]
    need = f"; at this rate about {u['seconds_needed']} s more would finish it" if u.get("seconds_needed") else ""
    return (f"WARNING: the {u['phase']} phase did not finish within {budget}: {u['run']} of its {u['size']} cases "
            f"ran, so not every variant of every mutation family was tried ({u['cases_left']} cases short of "
            f"the random phase{need})")

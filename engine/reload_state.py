"""The reload state machine: one table of legal transitions and the guard that applies it
(after asyncpg's ``Transaction._check_state``).

The phases are :class:`engine.status.ReloadState` — the enum INFO already reports — so this
module only adds what happens to a reload (``ReloadEvent``) and where each event leads::

    idle/swapped/failed/dropped ──stage build──▶ loading      (shadow; in-place with no model)
    idle/swapped/failed/dropped ──stage drain──▶ draining     (in-place with a live model)
    loading  ──shadow built──▶ draining ──swap──▶ swapped      (shadow)
    draining ──free old──▶ loading ──swap──▶ swapped           (in-place)
    loading  ──build failed──▶ failed
    loading, draining ──drop──▶ dropped                        (superseded, timed out, stopping)

A staged reload always ends before the next one is staged (a newer config first drops the
pending one), so staging is legal from the final phases only.
"""
from __future__ import annotations

import enum

from .status import ReloadState

IDLE, LOADING, DRAINING = ReloadState.IDLE, ReloadState.LOADING, ReloadState.DRAINING
SWAPPED, FAILED, DROPPED = ReloadState.SWAPPED, ReloadState.FAILED, ReloadState.DROPPED


class IllegalReloadTransition(RuntimeError):
    """An event the reload table does not allow in the current phase: a bug in the reloader."""


class ReloadEvent(enum.Enum):
    STAGE_BUILD = "stage build"  # shadow (or in-place with no model left to free): build now
    STAGE_DRAIN = "stage drain"  # in-place with a live model: drain before anything is freed
    SHADOW_BUILT = "shadow built"  # built beside the live model: drain, then swap
    FREE_OLD = "free old"  # in-place, drained: uninstall the old model (freed off-loop), then build
    SWAP = "swap"  # the new model goes live
    BUILD_FAILED = "build failed"  # the old config keeps serving (in-place: once restored)
    DROP = "drop"  # superseded by a newer config, drain timeout, or the engine stopping


_FINAL = (IDLE, SWAPPED, FAILED, DROPPED)

TRANSITIONS: dict[tuple[ReloadState, ReloadEvent], ReloadState] = {
    **{(phase, ReloadEvent.STAGE_BUILD): LOADING for phase in _FINAL},
    **{(phase, ReloadEvent.STAGE_DRAIN): DRAINING for phase in _FINAL},
    (LOADING, ReloadEvent.SHADOW_BUILT): DRAINING,
    (DRAINING, ReloadEvent.FREE_OLD): LOADING,
    (DRAINING, ReloadEvent.SWAP): SWAPPED,  # shadow: drained
    (LOADING, ReloadEvent.SWAP): SWAPPED,  # built with no live model (in-place: freed first)
    (LOADING, ReloadEvent.BUILD_FAILED): FAILED,
    (LOADING, ReloadEvent.DROP): DROPPED,
    (DRAINING, ReloadEvent.DROP): DROPPED,
}


def next_phase(phase: ReloadState, event: ReloadEvent) -> ReloadState:
    """Where ``event`` takes a reload in ``phase``; raises IllegalReloadTransition if nowhere."""
    try:
        return TRANSITIONS[phase, event]
    except KeyError:
        raise IllegalReloadTransition(f"reload event '{event.value}' is not allowed while "
                                      f"{phase.value}") from None

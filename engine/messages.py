"""The engine actor's mailbox messages: frozen dataclasses, dispatched by type.

A message that wants an answer travels with a future; the reloader's own messages
(``BuildDone``, ``DrainTimeout``) live in ``engine.reloader``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .jobs import GenJob


@dataclass(frozen=True)
class Submit:
    job: GenJob


@dataclass(frozen=True)
class StateGet:
    slot: int


@dataclass(frozen=True)
class StatePut:
    slot: int
    tokens: list[int]
    state: bytes | bytearray | memoryview
    declared: Any = None  # the sender's kv_cache (engine.kv_cache.check_declared), when it sent one


@dataclass(frozen=True)
class Erase:
    slot: int


@dataclass(frozen=True)
class WithModel:
    """Run ``fn(model)`` on the inference thread between two steps (tokenize, render a chat):
    the live model cannot be swapped or freed meanwhile."""

    fn: Any


@dataclass(frozen=True)
class Configure:
    cfg: Mapping[str, Any]


@dataclass(frozen=True)
class Wake:
    """Nothing to do but look at the state again (the engine is stopping, a paused job's client
    caught up or went away)."""

"""Slots and their published snapshots.

A ``Slot`` is owned by the engine actor (and, during a step, by the inference
thread the actor is awaiting — never both at once). A ``SlotSnapshot`` is an
immutable copy published after every step; STATE_META, INFO, ``/slots`` read
snapshots and never wait for the actor (the wire layer shapes them into JSON).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .status import ModelIdentity


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    slot_id: int
    n_past: int
    state_size: int
    is_processing: bool
    is_transferring: bool
    operation: str  # idle | prefill | decode | state_get | state_put
    tokens_processed: int
    tokens_total: int
    elapsed_ms: float
    config_generation: int
    queued: int
    identity: ModelIdentity
    job_id: int | None  # the generation job running here

    @property
    def progress(self) -> float:
        return (self.tokens_processed / self.tokens_total) if self.tokens_total else 0.0


@dataclass
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)  # what the sequence's KV holds, in order
    # sampled tokens not yet decoded into the KV (the last token of a finished generation);
    # a continuation feeds them first
    tail: list[int] = field(default_factory=list)
    state_size: int = 0
    operation: str = "idle"
    transferring: bool = False
    job: Any = None  # the generation job running here
    queue: deque = field(default_factory=deque)  # generation jobs waiting for this slot
    tokens_processed: int = 0
    tokens_total: int = 0
    started: float = 0.0
    generation: int = 0  # config generation the KV was computed with
    last_used: int = 0  # when a job or a state last came here (a counter): least recently used first

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def busy(self) -> bool:
        return self.job is not None or self.transferring

    def begin(self, operation: str, total: int) -> None:
        self.operation = operation
        self.tokens_processed = 0
        self.tokens_total = total
        self.started = time.monotonic()

    def finish(self) -> None:
        self.operation = "idle"
        self.job = None

    def snapshot(self, generation: int, identity: ModelIdentity) -> SlotSnapshot:
        busy = self.operation != "idle"
        return SlotSnapshot(
            slot_id=self.id,
            n_past=self.n_past,
            state_size=self.state_size,
            is_processing=self.job is not None,
            is_transferring=self.transferring,
            operation=self.operation,
            tokens_processed=self.tokens_processed,
            tokens_total=self.tokens_total,
            elapsed_ms=(time.monotonic() - self.started) * 1000 if busy else 0.0,
            config_generation=self.generation if self.tokens else generation,
            queued=len(self.queue),
            identity=identity,
            job_id=self.job.id if self.job is not None else None,
        )

"""Slots and their published snapshots.

A ``Slot`` is owned by the engine actor (and, during a step, by the inference
thread the actor is awaiting — never both at once). A ``SlotSnapshot`` is an
immutable copy published after every step; STATE_META, INFO, ``/slots`` read
snapshots and never wait for the actor (the wire layer shapes them into JSON).
Everything that depends on the time (elapsed, since progress, rates) is computed
when the snapshot is read, so it keeps moving while nothing republishes.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .rates import RateWindow, Samples, rate
from .sampling import SamplerParams
from .status import ModelIdentity

# operation → the summary INFO reports per slot
SLOT_STATES = {"idle": "idle", "prefill": "prefill", "decode": "decode", "state_get": "transfer",
               "state_put": "transfer"}


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
    started: float  # monotonic start of the operation
    last_progress: float  # monotonic time of the last token or prefill chunk (the start before one)
    rate_samples: Samples  # tokens_processed over the current phase (see engine.rates)
    config_generation: int
    queued_jobs: tuple[int, ...]  # ids of the generation jobs waiting for this slot, next first
    identity: ModelIdentity
    job_id: int | None  # the generation job running here
    # why work on this slot waits: client | transfer | reload | queue | None (see docs/protocol.md §6.2)
    waiting_on: str | None
    # the running job's (else the last one's) request and how far it got
    n_predict: int
    n_decoded: int
    has_new_line: bool  # its last token's text held a newline
    sampling: SamplerParams | None  # None: no job ran here yet
    stop: tuple[str, ...]

    @property
    def busy(self) -> bool:
        return self.operation != "idle"

    @property
    def queued(self) -> int:
        return len(self.queued_jobs)

    @property
    def state(self) -> str:
        """idle | prefill | decode | transfer."""
        return SLOT_STATES.get(self.operation, self.operation)

    @property
    def queue_position(self) -> int | None:
        """Where the newest waiting job stands (1: next to run), when jobs wait behind another."""
        return self.queued if self.waiting_on == "queue" else None

    @property
    def progress(self) -> float:
        return (self.tokens_processed / self.tokens_total) if self.tokens_total else 0.0

    @property
    def n_remain(self) -> int:
        """Tokens of work left while busy (prompt still to evaluate plus tokens still to generate),
        never 0 while a job runs; 0 when idle."""
        if self.job_id is None:
            return 0
        return max(1, self.tokens_total - self.tokens_processed)

    def elapsed_ms(self, now: float) -> float:
        return (now - self.started) * 1000 if self.busy else 0.0

    def ms_since_progress(self, now: float) -> float | None:
        return (now - self.last_progress) * 1000 if self.busy else None

    def tokens_per_s(self, now: float) -> float:
        """The rate of the current phase (prompt tokens while prefilling, generated ones after)."""
        return rate(self.rate_samples, self.tokens_processed, now) if self.busy else 0.0

    def eta_ms(self, now: float) -> float | None:
        """The remaining tokens at the recent rate, when both are known."""
        r = self.tokens_per_s(now)
        if not self.busy or self.tokens_total <= 0 or r <= 0:
            return None
        return max(0, self.tokens_total - self.tokens_processed) / r * 1000


@dataclass
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)  # what the sequence's KV holds, in order
    # sampled tokens not yet decoded into the KV (the last token of a finished generation);
    # a continuation feeds them first
    tail: list[int] = field(default_factory=list)
    # the logits of the slot's last token, when they are known: a PREFILL computed them, or a
    # state was put here with its logits tail (STATE_PUT, a DECODE v3 kv segment). A
    # continuation samples from them instead of decoding that token again — which a recurrent
    # memory could only do from a checkpoint or by computing the whole prompt. Dropped when
    # anything else changes the slot.
    last_logits: Any = None
    state_size: int = 0
    state_size_at: float = 0.0  # monotonic time state_size was last measured (the stepper's)
    operation: str = "idle"
    transferring: bool = False
    job: Any = None  # the generation job running here
    last_job: Any = None  # the one that ran here before (its parameters stay visible in /slots)
    queue: deque = field(default_factory=deque)  # generation jobs waiting for this slot
    erase_waiters: list = field(default_factory=list)  # futures of deferred erases (engine/erase.py)
    tokens_processed: int = 0
    tokens_total: int = 0
    started: float = 0.0
    last_progress: float = 0.0
    rate: RateWindow = field(default_factory=RateWindow)
    n_decoded: int = 0
    has_new_line: bool = False
    generation: int = 0  # config generation the KV was computed with
    last_used: int = 0  # when a job or a state last came here (a counter): least recently used first
    # an idle slot's last snapshot and what it was built from (see snapshot())
    _idle_snapshot: tuple[tuple, "SlotSnapshot"] | None = field(default=None, repr=False, compare=False)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def busy(self) -> bool:
        return self.job is not None or self.transferring

    def begin(self, operation: str, total: int) -> None:
        self.tokens_processed = 0
        self.tokens_total = total
        self.started = time.monotonic()
        self.n_decoded = 0
        self.has_new_line = False
        self.enter(operation, self.started)

    def enter(self, operation: str, now: float) -> None:
        """A new phase of the current work (prefill → decode): its rate starts afresh."""
        self.operation = operation
        self.last_progress = now
        self.rate.restart(self.tokens_processed, now)

    def advance(self, n: int, now: float) -> None:
        """``n`` more tokens processed (a prefill chunk, or one generated token)."""
        self.tokens_processed += n
        self.last_progress = now
        self.rate.record(self.tokens_processed, now)

    def finish(self) -> None:
        self.operation = "idle"
        self.last_job, self.job = self.job, None

    def snapshot(self, generation: int, identity: ModelIdentity, reload_holds: bool = False) -> SlotSnapshot:
        """``reload_holds``: a pending reload keeps this slot from starting new work now.

        An idle slot (no job, none queued, no operation) gives back its previous snapshot when
        nothing it is built from has changed: the actor publishes every slot after every step,
        on the path between two steps where the inference thread waits, and an idle slot's
        snapshot took ~6.5 µs to build against 0.3 µs to reuse (docs/performance.md)."""
        job = self.job
        key = None
        if job is None and not self.queue and self.operation == "idle":
            key = (generation, identity, reload_holds, self.last_job, self.transferring, len(self.tokens),
                   self.generation, self.state_size, self.tokens_processed, self.tokens_total, self.started,
                   self.last_progress, self.n_decoded, self.has_new_line)
            cached = self._idle_snapshot
            if cached is not None and cached[0] == key:
                return cached[1]
        snap = self._build_snapshot(generation, identity, reload_holds)
        self._idle_snapshot = (key, snap) if key is not None else None
        return snap

    def _build_snapshot(self, generation: int, identity: ModelIdentity, reload_holds: bool) -> SlotSnapshot:
        job = self.job
        shown = job if job is not None else self.last_job
        return SlotSnapshot(
            slot_id=self.id,
            n_past=self.n_past,
            state_size=self.state_size,
            is_processing=job is not None,
            is_transferring=self.transferring,
            operation=self.operation,
            tokens_processed=self.tokens_processed,
            tokens_total=self.tokens_total,
            started=self.started,
            last_progress=self.last_progress,
            rate_samples=self.rate.frozen() if self.operation != "idle" else (),
            config_generation=self.generation if self.tokens else generation,
            queued_jobs=tuple(j.id for j in self.queue),
            identity=identity,
            job_id=job.id if job is not None else None,
            waiting_on=self._waiting_on(reload_holds),
            n_predict=shown.request.n_predict if shown is not None else 0,
            n_decoded=self.n_decoded,
            has_new_line=self.has_new_line,
            sampling=shown.request.sampling if shown is not None else None,
            stop=tuple(shown.request.stop) if shown is not None else (),
        )

    def _waiting_on(self, reload_holds: bool) -> str | None:
        if self.transferring:
            return "transfer"
        if self.job is not None:
            if self.job.client_blocked:
                return "client"
            return "queue" if self.queue else None
        if reload_holds:
            return "reload"
        return "queue" if self.queue else None

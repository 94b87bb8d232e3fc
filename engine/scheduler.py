"""Generation jobs on slots: queueing, admission, cancellation, results.

One job runs per slot; more wait in the slot's queue (bounded: a full queue answers BUSY).
A job that names no slot takes the slot ``engine.slot_choice`` picks when it is admitted, or
waits in the shared queue (bounded by ``slot_queue`` per slot) for the first slot to free.
A job is admitted only while the gate is open (a model is live and no reload is draining)
and only onto the config it names, if it names one. Cancelled jobs leave before the next
step. Owned by the engine actor; the inference thread touches ``Running`` objects only
while the actor awaits a step.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from .jobs import EngineBusy, GenJob, GenResult, ModelChanged
from .model_params import ModelParams
from .slot_choice import choose_slot
from .slots import Slot
from .status import ModelIdentity
from .stepper import Running


@dataclass(frozen=True)
class Serving:
    """What admission needs to know about the live config."""

    open: bool  # a model is live and no reload is draining
    params: ModelParams
    generation: int
    identity: ModelIdentity


class Scheduler:
    def __init__(self, slots: list[Slot], slot_queue: int, stats: dict[str, int], similarity: float = 0.0):
        self.slots = slots
        self.slot_queue = slot_queue
        self.stats = stats
        self.similarity = similarity  # --slot-prompt-similarity
        self.shareable = False  # the live model can copy prompt prefixes between slots (set by the engine)
        self.running: dict[int, Running] = {}  # slot id → its running job
        self.unassigned: deque[GenJob] = deque()  # jobs naming no slot, waiting for any
        self._clock = itertools.count(1)  # Slot.last_used
        self._staged: deque[tuple[Running, list]] = deque()  # handed-over tokens not in their streams yet
        self._staging = False  # a turn of the loop will deliver the next of them

    def quiescent(self) -> bool:
        """Nothing runs and no state transfer is in flight: a reload may swap now."""
        return not self.running and not any(s.transferring for s in self.slots)

    def busy_slots(self) -> list[int]:
        return sorted(self.running)

    def active(self) -> list[Running]:
        """The running jobs to step now: not finished, and not paused on a client that is not reading."""
        return [r for r in self.running.values() if not r.finished and not r.job.client_blocked]

    def touch(self, slot: Slot) -> None:
        """Something came to this slot (a job, a state): it is the most recently used."""
        slot.last_used = next(self._clock)

    def offer(self, job: GenJob, serving: Serving) -> None:
        """A submitted job: admit it, queue it, or refuse it (queue full)."""
        if job.slot is None:
            self._offer_unassigned(job, serving)
            return
        slot = self.slots[job.slot]
        if job.cancelled:
            fail(job, asyncio.CancelledError())
        elif slot.busy or slot.queue or slot.erase_waiters or not serving.open:
            if not job.request.wait and (slot.busy or slot.queue or slot.erase_waiters):
                fail(job, EngineBusy(f"slot {slot.id} is busy"))
            elif len(slot.queue) >= self.slot_queue:
                fail(job, EngineBusy(f"slot {slot.id} is busy and its queue is full"))
            else:
                slot.queue.append(job)
        else:
            self._admit(slot, job, serving)

    def _offer_unassigned(self, job: GenJob, serving: Serving) -> None:
        slot = choose_slot(self.slots, job.tokenized[1] if job.tokenized else None, self.similarity,
                           self.shareable) if serving.open else None
        if job.cancelled:
            fail(job, asyncio.CancelledError())
        elif slot is not None and not self.unassigned:
            self._admit(slot, job, serving)
        elif len(self.unassigned) >= self.slot_queue * len(self.slots):
            fail(job, EngineBusy(f"all {len(self.slots)} slots are busy and the queue is full"))
        else:
            self.unassigned.append(job)

    def admit_queued(self, serving: Serving) -> None:
        for slot in self.slots:
            self._start_next(slot, serving)

    def reap_cancelled(self, serving: Callable[[], Serving]) -> None:
        """``serving()`` is asked only if a running job is finished here (every step passes by)."""
        for r in [r for r in self.running.values() if r.job.cancelled and not r.finished]:
            r.stop_reason = "cancelled"
            self.finish(r, serving())
        for queue in [slot.queue for slot in self.slots] + [self.unassigned]:
            for job in [j for j in queue if j.cancelled]:
                queue.remove(job)
                fail(job, asyncio.CancelledError())

    def deliver(self, batch: list[tuple[Running, list]]) -> None:
        """Tokens a running step handed over, to their jobs' streams (event loop): one job's a
        turn of the loop. Every stream woken in one turn writes before the loop next reads its
        sockets, so a ``/slots`` read or a new request that arrives meanwhile would wait for
        all of their writes; one a turn, it waits for one."""
        self._staged.extend(batch)
        if not self._staging:
            self._deliver_next()

    def _deliver_next(self) -> None:
        if self._staged:
            r, events = self._staged.popleft()
            self._put_now(r, events)
        self._staging = bool(self._staged)
        if self._staging:
            asyncio.get_running_loop().call_soon(self._deliver_next)

    def _put(self, r: Running, events: list) -> None:
        self._flush_staged()  # what was handed over before goes first
        self._put_now(r, events)

    def _flush_staged(self) -> None:
        while self._staged:
            self._put_now(*self._staged.popleft())

    def _put_now(self, r: Running, events: list) -> None:
        for ev in events:
            r.job.events.put_nowait(ev)
        self.stats["tokens_generated"] += len(events)

    def after_step(self, running: list[Running], serving: Callable[[], Serving]) -> bool:
        """Deliver the step's tokens; finish the jobs that are done (``serving()`` is asked only
        then). True when one was."""
        ended = False
        for r in running:
            if r.events:
                self._put(r, r.events)
                r.events.clear()
            if r.t_prefill_done and not r.prompt_counted:
                self._count_prompt(r, r.t_prefill_done)
            if r.finished or r.job.cancelled:
                self.finish(r, serving())
                ended = True
        return ended

    def stop_all(self, exc: BaseException, serving: Serving) -> None:
        """Engine stopping: fail what waits (first: finishing a job admits the next), cancel what runs."""
        for queue in [slot.queue for slot in self.slots] + [self.unassigned]:
            while queue:
                fail(queue.popleft(), exc)
        for r in list(self.running.values()):
            r.job.cancel()
            self.finish(r, serving)

    def finish(self, r: Running, serving: Serving) -> None:
        slot, job = r.slot, r.job
        self.running.pop(slot.id, None)
        if r.last is not None and r.error is None:
            # the last token sampled (and streamed), not in the KV yet, whatever ended the job (its
            # length, a stop, a full context, a cancel): a continuation of the slot feeds it first.
            # Dropped, it would decode the slot's last token again for its logits, which a
            # recurrent memory can only do from a checkpoint or from the start
            slot.tail = [r.last]
        slot.finish()
        if r.sampler is not None:
            r.sampler.free()
        self._flush_staged()  # the job's last tokens before its end
        job.events.put_nowait(None)
        if job.done is not None and not job.done.done():
            if r.error is not None:
                job.done.set_exception(r.error)
            else:
                job.done.set_result(self._result(r, serving.identity))
        self._start_next(slot, serving)

    def _result(self, r: Running, identity: ModelIdentity) -> GenResult:
        now = time.perf_counter()
        pre_end = r.t_prefill_done or now
        if not r.prompt_counted:
            self._count_prompt(r, pre_end)
        self.stats["predicted_seconds"] += now - pre_end
        self.stats["n_tokens_max"] = max(self.stats["n_tokens_max"], r.slot.n_past)
        return GenResult(
            slot=r.slot.id, n_past=r.slot.n_past, prompt_tokens=r.prompt_tokens,
            tokens_generated=len(r.generated), stop_reason=r.stop_reason or "cancelled",
            config_generation=r.generation, identity=identity,
            prefill_ms=(pre_end - r.t_start) * 1000 if r.t_start else 0.0,
            decode_ms=(now - pre_end) * 1000, cached_tokens=r.cached_tokens, state=r.state,
            logits=r.logits, tokens=list(r.slot.tokens), generated=r.generated, text=bytes(r.text))

    def _count_prompt(self, r: Running, prefill_end: float) -> None:
        """A prompt counts once it is evaluated (as llama-server counts it), not when its job ends."""
        r.prompt_counted = True
        self.stats["prompt_tokens"] += r.prompt_tokens - r.cached_tokens
        self.stats["prompt_tokens_cached"] += r.cached_tokens
        self.stats["prompt_seconds"] += (prefill_end - r.t_start) if r.t_start else 0.0

    def _start_next(self, slot: Slot, serving: Serving) -> None:
        if slot.busy or slot.erase_waiters or not serving.open:  # a deferred erase goes first
            return
        # the slot's own queue first (those jobs can only run here), then the shared one
        for queue in (slot.queue, self.unassigned):
            while queue:
                job = queue.popleft()
                if job.cancelled:
                    fail(job, asyncio.CancelledError())
                elif self._admit(slot, job, serving):
                    return

    def _admit(self, slot: Slot, job: GenJob, serving: Serving) -> bool:
        if job.request.params is not None and job.request.params != serving.params:
            fail(job, ModelChanged(
                f"the model config this request named was replaced before it ran (config generation "
                f"{serving.generation} serves {serving.params.model_path}); retry"))
            return False
        job.slot = slot.id
        slot.job = job
        self.touch(slot)
        slot.generation = serving.generation
        slot.begin("prefill", 0)
        self.stats["jobs"] += 1
        self.running[slot.id] = Running(job, slot, serving.generation)
        return True


def fail(job: GenJob, exc: BaseException) -> None:
    job.events.put_nowait(None)
    if job.done is not None and not job.done.done():
        if isinstance(exc, asyncio.CancelledError):
            job.done.cancel()
        else:
            job.done.set_exception(exc)

"""The actor's slot state operations: STATE_GET, STATE_PUT and ERASE, run between two steps.

A mixin of ``engine.actor.EngineActor`` (its state is the actor's: ``slots``, ``model``, the
inference thread): kept apart because a state transfer is its own small protocol — the slot
is marked transferring, the bytes cross the inference thread, every claim in a put is checked
before anything changes (docs/architecture.md, "State transfer").
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from codec.errors import CodecError
from codec.kvblob import is_logits_tail

from .config import StateOut
from .jobs import EngineBusy
from .kv_cache import BadDeclaration, KvStateMismatch, restore_state
from .messages import Erase, StateGet, StatePut
from .slots import Slot

log = logging.getLogger("engine.actor")


def logits_tail(state: Any, consumed: int, model: Any) -> np.ndarray | None:
    """The logits of the state's last token, when they follow the bytes the loader consumed."""
    if not is_logits_tail(len(state) - consumed, model.n_vocab):
        return None
    return np.frombuffer(state, dtype=np.float32, offset=consumed).copy()


class SlotStateOps:
    def _require_idle(self, slot_id: int, what: str = "busy") -> Slot:
        if self.model is None:  # an in-place reload freed it and is loading the next one
            raise EngineBusy("no model loaded: an in-place reload is in progress", self._retry_after_ms())
        slot = self.slots[slot_id]
        if slot.busy:
            raise EngineBusy(f"slot {slot_id} is {what}")
        return slot

    async def _on_state_get(self, msg: StateGet) -> StateOut:
        slot = self._require_idle(msg.slot)
        slot.transferring = True
        slot.begin("state_get", slot.n_past)
        self._publish()
        loop = asyncio.get_running_loop()
        model = self.model
        release = None
        try:
            size = await loop.run_in_executor(self._infer, model.state_seq_size, slot.id)
            buf, release = self._state_buf.lease(size)
            n = await loop.run_in_executor(self._infer, model.state_seq_get_into, slot.id, buf)
        except BaseException:
            if release is not None:
                release()
            raise
        finally:
            slot.transferring = False
            slot.operation = "idle"
        slot.state_size = n
        self._publish()
        return StateOut(slot.n_past, list(slot.tokens), buf[:n].toreadonly(), self.identity,
                        slot.generation, release)

    async def _on_state_put(self, msg: StatePut) -> int:
        slot = self._require_idle(msg.slot)
        slot.transferring = True
        slot.begin("state_put", len(msg.tokens))
        self._publish()
        model = self.model

        def load() -> tuple[int, int, int, np.ndarray | None]:
            n = restore_state(model, slot.id, msg.state, msg.declared)  # every claim is checked first
            return n, model.seq_pos_max(slot.id), model.state_seq_size(slot.id), logits_tail(msg.state, n, model)

        try:
            n, pos_max, size, logits = await asyncio.get_running_loop().run_in_executor(self._infer, load)
        except (CodecError, KvStateMismatch, BadDeclaration):
            raise  # refused before anything changed: the slot keeps what it held
        except Exception:
            slot.tokens, slot.tail, slot.last_logits = [], [], None
            raise
        finally:
            slot.transferring = False
            slot.operation = "idle"
        n_kv = pos_max + 1
        # Positions whose token we do not know get -1: they never match a prompt, so prefix
        # reuse stops there, and a continuation cannot re-feed an unknown token.
        slot.tokens = (list(msg.tokens[:n_kv]) + [-1] * max(0, n_kv - len(msg.tokens)))
        slot.tail = []
        # the logits belong to the state's last token only when the tokens say which that is
        slot.last_logits = logits if n_kv == len(msg.tokens) > 0 else None
        self.cache.checkpoints.forget(slot.id)  # they belong to the state just replaced
        slot.state_size = size
        slot.generation = self.generation
        self.scheduler.touch(slot)
        self._publish()
        return n

    async def _on_erase(self, msg: Erase) -> int | asyncio.Future:
        slot = self.slots[msg.slot]
        if self.model is not None and (slot.busy or slot.erase_waiters):
            return self.erases.add(slot)  # the caller awaits it; done by _erase_deferred
        return await self._erase_now(self._require_idle(msg.slot, "processing"))

    async def _erase_now(self, slot: Slot) -> int:
        n = slot.n_past
        await asyncio.get_running_loop().run_in_executor(self._infer, self._clear_slot, slot)
        self._publish()
        return n

    def _clear_slot(self, slot: Slot) -> None:
        """Inference thread: the slot's sequence, cached tokens and checkpoints are gone."""
        self.model.seq_clear(slot.id)
        slot.tokens, slot.tail, slot.state_size, slot.last_logits = [], [], 0, None
        self.cache.checkpoints.forget(slot.id)

    def _free_idle_slots(self, running: list[Any]) -> bool:
        """Inference thread, inside a step whose batch found the unified KV cache full: the
        slots no job runs on give up their cached prompts, as llama-server's
        ``try_clear_idle_slots`` does (their next prompt is computed again). True if any did."""
        busy = {r.slot.id for r in running}
        freed = False
        for slot in self.slots:
            if slot.id in busy or slot.transferring or not (slot.tokens or slot.tail):
                continue
            log.info("the KV cache is full: idle slot %d gives up its %d cached tokens", slot.id, len(slot.tokens))
            self._clear_slot(slot)
            freed = True
        return freed

    async def _erase_deferred(self) -> None:
        """Erase the slots freed since an erase was deferred, then admit what they held back."""
        for slot in self.erases.due():
            if self.model is None:
                continue  # an in-place reload is building: the slots are empty once it is done
            try:
                self.erases.answer(slot, await self._erase_now(slot))
            except Exception as e:
                self.erases.answer(slot, 0, e)
        self.scheduler.admit_queued(self._serving())
        self._publish()


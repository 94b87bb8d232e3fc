"""Shrink a failing case while it still fails the same oracle.

Byte cases go through four passes, biggest wins first:

1. drop whole messages, then whole requests inside a message (a pipelined burst);
2. per request that is well-formed: empty the key, the trace, cut the payload — with the
   length fields fixed up, so a desync reproducer stays a clean "op + payload" request;
3. cut bytes off the end of each message (keeps deliberate length lies intact);
4. delta debugging (ddmin) over each message's bytes, bounded.

Step programs drop steps (ddmin) while every blob reference still resolves. Every
candidate is judged by ``still_fails`` (re-running it against the target); the budget
(attempts and seconds) bounds the whole thing and the best case so far is kept.
"""
from __future__ import annotations

import time
from typing import Awaitable, Callable

from codec.frames import split_frames

from .cases import Case, Message
from .mutators import frame
from .stateful import valid_program

Predicate = Callable[[Case], Awaitable[bool]]


class _OutOfBudget(Exception):
    pass


class Minimizer:
    def __init__(self, still_fails: Predicate, max_attempts: int = 200, max_seconds: float = 30.0):
        self._still_fails = still_fails
        self.max_attempts = max_attempts
        self.deadline = time.monotonic() + max_seconds
        self.attempts = 0
        self.best: Case | None = None
        self._seen: set[str] = set()

    async def test(self, case: Case) -> bool:
        key = case.digest()
        if key in self._seen:
            return False
        self._seen.add(key)
        if self.attempts >= self.max_attempts or time.monotonic() > self.deadline:
            raise _OutOfBudget
        self.attempts += 1
        return await self._still_fails(case)

    async def run(self, case: Case) -> Case:
        """The smallest still-failing case found within the budget (``case`` itself at worst)."""
        self.best = case
        self._seen.add(case.digest())
        try:
            if case.program is not None:
                await self._program(case)
            elif case.messages:
                await self._messages(case)
        except _OutOfBudget:
            pass
        return self.best

    # ---------------------------------------------------------------- generic ddmin
    async def _ddmin(self, items: list, build: Callable[[list], Case | None]) -> list:
        n = 2
        while len(items) >= 2:
            size = -(-len(items) // n)
            progressed = False
            for start in range(0, len(items), size):
                cand_items = items[:start] + items[start + size:]
                cand = build(cand_items)
                if cand is not None and await self.test(cand):
                    items, n, progressed = cand_items, max(n - 1, 2), True
                    self.best = cand
                    break
            if not progressed:
                if n >= len(items):
                    break
                n = min(len(items), n * 2)
        return items

    # ---------------------------------------------------------------- step programs
    async def _program(self, case: Case) -> Case:
        steps = await self._ddmin(list(case.program),
                                  lambda st: case.with_program(st) if st and valid_program(st) else None)
        return case.with_program(steps)

    # ---------------------------------------------------------------- byte messages
    async def _messages(self, case: Case) -> Case:
        msgs = list(case.messages)
        if len(msgs) > 1:
            msgs = await self._ddmin(msgs, lambda ms: case.with_messages(ms) if ms else None)
        for i in range(len(msgs)):
            msgs = await self._simplify_mode(case, msgs, i)
            msgs = await self._frames(case, msgs, i)
            msgs = await self._well_formed(case, msgs, i)
            msgs = await self._tail_cut(case, msgs, i)
            msgs = await self._bytes(case, msgs, i)
        return case.with_messages(msgs)

    def _with(self, case: Case, msgs: list[Message], i: int, data: bytes | None = None, **kw) -> Case:
        m = msgs[i]
        new = Message(m.data if data is None else data, kw.get("mode", m.mode), m.chunk, m.delay_ms,
                      kw.get("then", m.then))
        return case.with_messages(msgs[:i] + [new] + msgs[i + 1:])

    async def _accept(self, cand: Case) -> bool:
        if await self.test(cand):
            self.best = cand
            return True
        return False

    async def _simplify_mode(self, case: Case, msgs: list[Message], i: int) -> list[Message]:
        m = msgs[i]
        if m.mode != "burst":
            cand = self._with(case, msgs, i, mode="burst")
            if await self._accept(cand):
                msgs = cand.messages
        if msgs[i].then != "none":
            cand = self._with(case, msgs, i, then="none")
            if await self._accept(cand):
                msgs = cand.messages
        return msgs

    async def _frames(self, case: Case, msgs: list[Message], i: int) -> list[Message]:
        split = split_frames(msgs[i].data)
        units = [f.raw for f in split.frames] + ([split.rest] if split.rest else [])
        if len(units) < 2:
            return msgs
        kept = await self._ddmin(units, lambda us: self._with(case, msgs, i, b"".join(us)) if us else None)
        return self._with(case, msgs, i, b"".join(kept)).messages

    async def _well_formed(self, case: Case, msgs: list[Message], i: int) -> list[Message]:
        """Shrink key, trace and payload of whole requests, keeping the length fields honest."""
        split = split_frames(msgs[i].data)
        frames, rest = [f.raw for f in split.frames], split.rest
        for j, sent in enumerate(split.frames):
            h, flags = sent.header, sent.header.flags
            parts = {"key": sent.key, "trace": sent.trace, "payload": sent.payload}

            async def attempt(**change: bytes) -> bool:
                new = {**parts, **change}
                cand_frame = frame(h.op, new["key"], new["payload"], new["trace"], flags=flags)
                cand = self._with(case, msgs, i, b"".join(frames[:j] + [cand_frame] + frames[j + 1:]) + rest)
                if await self._accept(cand):
                    parts.update(change)
                    frames[j] = cand_frame
                    return True
                return False

            if parts["trace"]:
                await attempt(trace=b"")
            if parts["key"]:
                await attempt(key=b"")
            # shortest payload prefix that still fails, payload_len following it (binary search)
            lo, hi = 0, len(parts["payload"])
            while lo < hi:
                mid = (lo + hi) // 2
                if await attempt(payload=parts["payload"][:mid]):
                    hi = mid
                else:
                    lo = mid + 1
            msgs = self._with(case, msgs, i, b"".join(frames) + rest).messages
        return msgs

    async def _tail_cut(self, case: Case, msgs: list[Message], i: int) -> list[Message]:
        data = msgs[i].data
        lo, hi = 1, len(data)  # hi always fails (it is the current data)
        while lo < hi:
            mid = (lo + hi) // 2
            cand = self._with(case, msgs, i, data[:mid])
            if await self._accept(cand):
                hi = mid
                msgs = cand.messages
            else:
                lo = mid + 1
        return msgs

    async def _bytes(self, case: Case, msgs: list[Message], i: int) -> list[Message]:
        data = msgs[i].data
        if len(data) > 4096:
            return msgs  # ddmin over so many bytes costs more than it reveals
        kept = await self._ddmin(list(data), lambda bs: self._with(case, msgs, i, bytes(bs)) if bs else None)
        return self._with(case, msgs, i, bytes(kept)).messages

"""Context checkpoints: llama-server's ``--ctx-checkpoints N`` (alias ``--swa-checkpoints``).

A recurrent or hybrid model's sequence state is the state after its last token: it cannot be
cut back to a shorter prefix (``seq_rm`` of a partial range fails), so a prompt that differs
from what a slot holds anywhere but at its end — a chat template that rewrites an earlier
turn, or merely the last token re-decoded to get its logits (a DECODE after a PREFILL) —
would be computed again from zero. A sliding-window cache has the same problem for prefixes
older than its window. A checkpoint is the part of a slot's state that cannot be cut back
(``checkpoint_get``: llama.cpp's ``PARTIAL_ONLY`` capture, the recurrent state or the window
cache), taken while a prompt is fed; the attention KV of the prefix stays in the slot.

As llama-server does (server-context.cpp, ``create_checkpoint`` and its callers):

* taken before the chunk that starts 4 + n_ubatch and 4 tokens before a prompt's end (each
  at most n_batch: ``tools/server`` cuts a prompt's batch there) — the prompt is cut into
  chunks there (``chunk_len``), so those positions exist. The earlier one is what the next
  prompt on the same document with another question restores: it computes ~n_ubatch tokens
  instead of the whole document;
* and, in a chat, before the chunk where the prompt's last user turn starts
  (``engine.chat.turns``, llama-server's ``message_spans``): the next conversation with the
  same system prompt and tools restores there;
* beyond llama-server, where a prompt parted from the slot's tokens when no checkpoint was
  there (``diverged``): the prompt restored an earlier one and computes the tokens between
  again. Prompts that share a prefix part at its end (another question on the same document,
  another conversation after the same system prompt), so the next one restores there and
  computes only its own part, as a memory that can be cut back does — llama-server computes
  about one ubatch again for each. Taken only where that saves at least DIVERGED_MIN_TOKENS;
* at most ``max_per_slot`` per slot: when full, one within ``min_step`` tokens of the
  checkpoint before it goes first, else the oldest; one at the same position is replaced;
* restored when a new prompt diverges inside the slot's tokens (``best`` + ``restore``):
  the newest checkpoint whose tokens are a prefix of both; the slot's cells after it are
  removed, and checkpoints past the kept prefix are dropped (``prune``).

A checkpoint is only valid together with the slot's attention cells of the same prefix, so
it is used only while the slot's tokens still start with its tokens, and forgotten when the
slot's state is replaced from outside (STATE_PUT, erase) or the model changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .backend import ModelBackend
from .buffers import Buffer

#: tokens before a prompt's end where checkpoints are taken (and 4 + n_ubatch), as llama-server
END_OFFSET = 4
#: buffers of dropped checkpoints a slot keeps for the next ones it takes (a prompt takes two):
#: a new buffer of tens of MiB costs ten times the copy into it, mostly the kernel's page faults
SPARE_PER_SLOT = 2
#: tokens a prompt must compute again before the point where it parted from the slot's tokens
#: for a checkpoint there: below that, the next prompt's recompute costs about what the copy
#: does (on the fleet's model a checkpoint is ~60 MiB, a token of prefill far more than its share)
DIVERGED_MIN_TOKENS = 64


@dataclass
class Checkpoint:
    tokens: list[int]  # the prefix the state is at: positions [0, len)
    state: bytes | Buffer | memoryview

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass
class Checkpoints:
    """Every slot's checkpoints (inference thread; the loop reads the counters)."""

    max_per_slot: int = 32  # llama-server's default n_ctx_checkpoints
    min_step: int = 8192  # llama-server's checkpoint_min_step
    per_slot: dict[int, list[Checkpoint]] = field(default_factory=dict)
    spare: dict[int, list[Buffer]] = field(default_factory=dict)  # dropped ones' buffers, per slot
    created: int = 0
    restored: int = 0

    def wanted(self, model: ModelBackend) -> bool:
        """Checkpoints help a memory that cannot be cut back: recurrent state, or a window
        cache that forgets (not with ``--swa-full``, whose window cache keeps every cell)."""
        return self.max_per_slot > 0 and (model.recurrent or (model.n_swa > 0 and not model.kv_shareable))

    @staticmethod
    def points(end: int, n_batch: int, n_ubatch: int, *marks: int | None) -> tuple[int, ...]:
        """Where checkpoints of a prompt of ``end`` tokens are taken, in order: before its end,
        and at ``marks`` (where its last user turn starts, a chat's: engine.chat.turns; where it
        parted from the slot's tokens: :meth:`diverged`)."""
        at = {end - min(n_batch, END_OFFSET + n_ubatch), end - min(n_batch, END_OFFSET)}
        at.update(m for m in marks if m is not None)
        return tuple(sorted(p for p in at if 0 < p < end))

    @staticmethod
    def diverged(kept: int, common: int, end: int, newest: int | None) -> int | None:
        """Where to checkpoint a prompt of ``end`` tokens that shares ``common`` tokens with
        what its slot held but kept only ``kept`` of them (restored at an earlier checkpoint):
        at ``common``, when the prompt goes on past it, computes enough again before it, and
        rewrote what an earlier prompt fed — it parts before the slot's ``newest`` checkpoint
        (a prompt's last is 4 tokens before its end). An agent's next turn parts after it, in
        the answer the template renders anew, and its own prompt's checkpoints serve the turn
        after: one there would be a copy for nothing."""
        if common - kept < DIVERGED_MIN_TOKENS or common >= end:
            return None
        return common if newest is None or common < newest else None

    def newest(self, seq: int) -> int | None:
        """The longest prefix one of ``seq``'s checkpoints holds (None: it has none)."""
        kept = self.per_slot.get(seq)
        return kept[-1].n if kept else None

    @staticmethod
    def chunk_len(held: int, want: int, points: tuple[int, ...]) -> int:
        """A prefill chunk of at most ``want`` tokens from ``held`` on, ending at the next
        checkpoint position (of :meth:`points`) so that the state there exists between two
        decodes."""
        for p in points:
            if held < p < held + want:
                return p - held
        return want

    def before_chunk(self, model: ModelBackend, seq: int, tokens: list[int], points: tuple[int, ...]) -> None:
        """Take a checkpoint if the slot (holding ``tokens``) is at one of its prompt's
        checkpoint positions (:meth:`points`), before its next chunk is decoded."""
        if len(tokens) not in points or -1 in tokens:
            return
        kept = self.per_slot.setdefault(seq, [])
        if kept and kept[-1].tokens == tokens:
            return  # this very state is kept already (a restored checkpoint being re-fed)
        self._drop(seq, kept, [c for c in kept if c.n == len(tokens)])
        while len(kept) >= self.max_per_slot:
            close = [i for i in range(1, len(kept)) if kept[i].n <= kept[i - 1].n + self.min_step]
            self._drop(seq, kept, [kept[close[0] if close else 0]])
        spare = self.spare.get(seq)
        kept.append(Checkpoint(list(tokens), model.checkpoint_get(seq, spare.pop() if spare else None)))
        kept.sort(key=lambda c: c.n)
        self.created += 1

    def best(self, seq: int, held: list[int], target: list[int], limit: int) -> Checkpoint | None:
        """The newest checkpoint of ``seq`` at most ``limit`` tokens long whose tokens start
        both what the slot holds and the new prompt."""
        for c in reversed(self.per_slot.get(seq, ())):
            if c.n <= limit and held[:c.n] == c.tokens and target[:c.n] == c.tokens:
                return c
        return None

    def restore(self, model: ModelBackend, seq: int, c: Checkpoint) -> bool:
        """Put ``seq`` back at checkpoint ``c``: its state, then the attention cells after it
        removed. False (the slot then holds what it held) when llama.cpp refuses either."""
        if not model.checkpoint_set(seq, c.state) or not model.seq_rm(seq, c.n, -1):
            return False
        self.restored += 1
        return True

    def hand_over(self, seq: int, leaving: list[Checkpoint]) -> None:
        """``leaving`` went with the slot's state to the RAM tier: out of the slot's list, and
        not as spares (the entry holds their buffers now)."""
        _remove(self.per_slot.get(seq, []), leaving)

    def adopt(self, seq: int, came: list[Checkpoint]) -> None:
        """``came`` with a state the RAM tier put back in the slot (prefixes of what it now
        holds); the oldest go past ``max_per_slot``."""
        kept = self.per_slot.setdefault(seq, [])
        have = {c.n for c in kept}
        kept += [c for c in came if c.n not in have]
        kept.sort(key=lambda c: c.n)
        del kept[:max(0, len(kept) - self.max_per_slot)]

    def prune(self, seq: int, tokens: list[int]) -> None:
        """The slot now holds ``tokens``: checkpoints that are not a prefix of them are stale."""
        kept = self.per_slot.get(seq)
        if kept:
            self._drop(seq, kept, [c for c in kept if not (c.n <= len(tokens) and tokens[:c.n] == c.tokens)])

    def forget(self, seq: int | None = None) -> None:
        """Drop one slot's checkpoints (its state was replaced), or every slot's (a new model),
        and their buffers."""
        if seq is None:
            self.per_slot.clear()
            self.spare.clear()
        else:
            self.per_slot.pop(seq, None)
            self.spare.pop(seq, None)

    def _drop(self, seq: int, kept: list[Checkpoint], dropped: list[Checkpoint]) -> None:
        """Take ``dropped`` out of ``kept`` (the slot's list, in place); their buffers become the
        slot's spares, up to SPARE_PER_SLOT."""
        if not dropped:
            return
        _remove(kept, dropped)
        spare = self.spare.setdefault(seq, [])
        for c in dropped:
            buf = c.state.obj if isinstance(c.state, memoryview) else c.state  # a mapping's capture is a view of it
            if len(spare) < SPARE_PER_SLOT and isinstance(buf, Buffer):
                spare.append(buf)

    # read from the event loop while the inference thread changes them: copy first (atomic
    # under the GIL), never iterate a live dict
    def count(self) -> int:
        return sum(len(v) for v in list(self.per_slot.values()))

    def n_bytes(self) -> int:
        """What checkpoints hold, their spare buffers included."""
        kept = sum(len(c.state) for v in list(self.per_slot.values()) for c in list(v))
        return kept + sum(len(b) for v in list(self.spare.values()) for b in list(v))

    def of_slot(self, seq: int) -> list[dict[str, int]]:
        """``/slots``: a slot's checkpoints, oldest first."""
        return [{"n_tokens": c.n, "size": len(c.state)} for c in list(self.per_slot.get(seq, ()))]


def _remove(kept: list[Checkpoint], gone: list[Checkpoint]) -> None:
    """Take ``gone`` out of ``kept`` in place (by identity: two checkpoints may be equal)."""
    ids = {id(c) for c in gone}
    kept[:] = [c for c in kept if id(c) not in ids]

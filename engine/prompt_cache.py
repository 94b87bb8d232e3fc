"""The prompt cache: line a slot's KV up with a new prompt, computing as little as possible.

At admission (inference thread) the prompt's longest prefix already held somewhere is
reused, from the best of three sources:

own     the slot's own KV — llama-server's ``cache_prompt``; beyond the common prefix,
        with ``cache_reuse`` N > 0, later chunks of ≥ N matching tokens are shifted into
        place (``seq_rm`` + ``seq_add``), as llama-server's ``--cache-reuse`` does
shared  another slot's KV (the same system prompt in another conversation): its cells are
        copied with ``llama_memory_seq_cp``, which with a unified KV cache only adds this
        slot's sequence id to the cells — no tensor data moves
host    the RAM tier (``engine.host_cache``): the state a conversation left when its slot
        was taken by another one, with the slot's checkpoints, loaded back through
        ``kv_cache.restore_state`` (its header checked against the live KV cache first, as a
        STATE_PUT's is) and cut back by its own cells or at one of those checkpoints

checkpoint  a context checkpoint of the slot (``engine.checkpoints``), when its own KV
        cannot be cut back to the common prefix

Before a slot gives up most of what it holds, its state goes to the RAM tier. A prefix is
only reused when its cells are all there: a sliding-window (SWA) cache forgets positions
older than the window, so a prefix of ``n`` tokens needs the cells from ``n - n_swa + 1``
on, and a recurrent or hybrid model's state is that of its last token only, so only all of
it serves (``prefix_intact``); otherwise it is recomputed — never decoded against missing
cells — and counted (``cut_refused``, ``tokens_recomputed``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from .backend import ModelBackend
from .checkpoints import Checkpoints
from .disk_tier import DiskTier
from .host_cache import CachedPrompt, HostCache, common_prefix, limit_from_mib, serves
from .jobs import BadInput
from .kv_cache import restore_state
from .model_params import ModelParams
from .slots import Slot
from .status import PromptCacheInfo, flat_fields

log = logging.getLogger("engine.prompt_cache")

# Below this many tokens a copy from another slot or the RAM tier is not worth a lookup, and
# a slot holding fewer is not worth saving.
MIN_SHARED_PREFIX = 16
SAVE_MIN_LOST = 64  # tokens a slot that keeps most of its prefix must lose for a RAM-tier save
# checkpoints that go with a saved state: the newest, its last prompt's two (4 + n_ubatch and 4
# before its end). The next turn restores there; older ones would multiply the entry's size
# (tens of MiB each on the fleet's model) for prompts that rewrite earlier turns.
ENTRY_CHECKPOINTS = 2


@dataclass
class CacheStats:
    """Counters since start. ``tokens_saved``: prompt tokens taken from a cache, not computed."""

    lookups: int = 0  # prompts lined up
    hits: int = 0  # … that reused at least one token
    tokens_saved: int = 0
    from_own: int = 0  # hits by source
    from_shared: int = 0
    from_host: int = 0
    from_checkpoint: int = 0
    chunks_shifted: int = 0  # cache_reuse chunks moved into place
    cut_refused: int = 0  # prompts whose common prefix with the slot could not be kept (no checkpoint)
    tokens_recomputed: int = 0  # … the tokens of those prefixes, computed again


@dataclass
class PromptCache:
    """What admission needs: every slot (donors), the RAM tier, and the live model's settings
    (``ModelParams.cache_prompt``: off, every new prompt is recomputed; ``cache_reuse``: the
    min chunk reused by KV shifting, 0 off) and key (``model_key``: entries made with another
    key are never loaded)."""

    slots: list[Slot]
    params: ModelParams
    host: HostCache | None
    model_key: Hashable = None
    stats: CacheStats = field(default_factory=CacheStats)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    reuse_refused: str = ""  # why --cache-reuse does nothing on the live model ("": it works or is off)
    _installs: int = 0  # models installed so far: part of the model key

    @classmethod
    def build(cls, slots: list[Slot], params: ModelParams, cache_ram_mib: int,
              slot_save_path: str | None, ctx_checkpoints: int = 32, checkpoint_min_step: int = 8192) -> "PromptCache":
        """The engine's cache: a RAM tier of ``cache_ram_mib`` (llama-server's ``--cache-ram``),
        spilling to a disk tier under ``slot_save_path`` when both are given and limited; up to
        ``ctx_checkpoints`` context checkpoints per slot (``--ctx-checkpoints``)."""
        host = None
        if cache_ram_mib:
            limit = limit_from_mib(cache_ram_mib)
            host = HostCache(limit, DiskTier(slot_save_path) if slot_save_path and limit else None)
        return cls(slots, params, host, checkpoints=Checkpoints(ctx_checkpoints, checkpoint_min_step))

    def install(self, model: ModelBackend, params: ModelParams) -> bool:
        """A new model (a new context) is live: its settings, a new key, and the RAM tier
        forgets the old model's states. Returns whether prompt prefixes can be copied between
        its slots."""
        self._installs += 1
        self.params = params
        self.model_key = (self._installs, params)
        if self.host is not None:
            self.host.keep_only(self.model_key)
        self.checkpoints.forget()
        # llama-server disables --cache-reuse on a context that cannot shift, with a warning
        self.reuse_refused = "" if not params.cache_reuse or model.can_shift else (
            "--cache-reuse needs a KV cache that can shift positions; this model's cannot "
            "(recurrent or hybrid memory): prompts reuse their common prefix only")
        if self.reuse_refused:
            log.warning("%s", self.reuse_refused)
        return params.cache_prompt and model.kv_shareable

    def close(self) -> None:
        if self.host is not None:
            self.host.close()

    def info(self) -> PromptCacheInfo:
        h = self.host
        ram = {} if h is None else dict(
            ram_limit_bytes=-1 if h.limit_bytes is None else h.limit_bytes, ram_entries=len(h), ram_bytes=h.n_bytes,
            ram_saves=h.stats.saves, ram_restores=h.stats.restores, ram_evictions=h.stats.evictions,
            ram_invalidated=h.stats.invalidated, disk_entries=len(h.spilled), disk_bytes=h.disk_bytes,
            disk_spills=h.stats.spilled, disk_restores=h.stats.disk_restores)
        ck = self.checkpoints
        return PromptCacheInfo(cache_prompt=self.params.cache_prompt, cache_reuse=self.params.cache_reuse,
                               cache_reuse_refused=self.reuse_refused, **flat_fields(self.stats), **ram,
                               ctx_checkpoints=ck.max_per_slot, checkpoints=ck.count(),
                               checkpoints_bytes=ck.n_bytes(), checkpoints_created=ck.created,
                               checkpoints_restored=ck.restored)

    def line_up(self, model: ModelBackend, slot: Slot, target: list[int], max_keep: int, *,
                continuation: bool = False) -> tuple[int, int | None]:
        """Make ``slot``'s KV hold the longest prefix of ``target`` it can get cheaply, at most
        ``max_keep`` tokens; returns that length (``slot.tokens`` is set to it) and where a
        checkpoint is to be taken for ``target`` parting from the slot's tokens
        (``Checkpoints.diverged``; None: nowhere).

        A ``continuation`` (the target extends what the slot holds: a DECODE, an append) keeps
        the slot's KV even with ``cache_prompt`` off, and as it is: there it is the session the
        client put there (maybe with tokens nobody knows), not a cache that could be recomputed.
        """
        self.stats.lookups += 1
        if not self.params.cache_prompt and not continuation:
            model.seq_clear(slot.id)
            slot.tokens = []
            self.checkpoints.forget(slot.id)
            return 0, None
        common = own = min(common_prefix(slot.tokens, target), max_keep)
        newest = self.checkpoints.newest(slot.id)  # before this prompt prunes them
        # a continuation keeps the slot's KV as it is, unless it cannot be cut back to it
        if own and (not continuation or model.recurrent) and not prefix_intact(model, slot.id, own):
            own = 0
        source, n, found = self._pick_source(model, slot, target, max_keep, own, common, continuation)
        # take the entry before saving the slot: the save may drop or evict entries
        if source == "host":
            try:
                found = self.host.take(found[0])
            except OSError:  # its disk-tier file is gone: compute instead
                source, n = "own", own
        self._save_if_losing(model, slot, own if source == "own" else n if source == "checkpoint" else 0, common, target)
        n = self._load_from(model, slot, target, source, n, found, own, max_keep)
        slot.tokens = target[:n]
        self.checkpoints.prune(slot.id, slot.tokens)
        self._count(target, source, n, common)
        parted = self.checkpoints.diverged(n, common, len(target), newest) if self.checkpoints.wanted(model) else None
        return n, parted

    def _pick_source(self, model: ModelBackend, slot: Slot, target: list[int], max_keep: int, own: int,
                     common: int, continuation: bool) -> tuple[str, int, Any]:
        """Where the longest prefix of ``target`` comes from: ``(source, tokens, what)`` with
        ``what`` the checkpoint, the donor ``(slot id, tokens)`` or the RAM-tier entry."""
        source, n, found = "own", own, None
        ckpt = self.checkpoints.best(slot.id, slot.tokens, target, common) if own < common else None
        if ckpt is not None and ckpt.n > own:
            source, n, found = "checkpoint", ckpt.n, ckpt
        # unknown tokens (-1, from a restored state) would match each other across slots
        elsewhere = self.params.cache_prompt and not continuation and -1 not in target
        donor = self._best_donor(model, slot, target, max_keep) if elsewhere else None
        if donor is not None and donor[1] >= n + MIN_SHARED_PREFIX:
            source, n, found = "shared", donor[1], donor
        if self.host is not None and elsewhere and max_keep >= n + MIN_SHARED_PREFIX:
            entry = self.host.best(self.model_key, target, model.n_swa, model.recurrent,
                                   at_least=n + MIN_SHARED_PREFIX)
            if entry is not None:
                source, n, found = "host", min(entry[1], max_keep), entry
        return source, n, found

    def _load_from(self, model: ModelBackend, slot: Slot, target: list[int], source: str, n: int, found: Any,
                   own: int, max_keep: int) -> int:
        """Put the prefix ``_pick_source`` chose into the slot's KV; returns the tokens it holds."""
        if source == "own":
            return self._keep_own(model, slot, target, own, max_keep)
        if source == "checkpoint":
            return n if self.checkpoints.restore(model, slot.id, found) else self._clear(model, slot)
        if source == "shared":
            model.seq_clear(slot.id)
            model.seq_copy_prefix(found[0], slot.id, n)
            return n
        return self._restore(model, slot, found, n)  # found: the RAM-tier entry taken

    def _count(self, target: list[int], source: str, n: int, common: int) -> None:
        """The lookup's statistics; BadInput when a prefix of unknown tokens must be recomputed."""
        if n < common:  # a prefix the slot held is computed again: say so
            self.stats.cut_refused += 1
            self.stats.tokens_recomputed += common - n
            if -1 in target[n:]:
                raise BadInput("the slot's state cannot be cut back to this prompt and holds tokens "
                               "whose ids are unknown (a restored state): send the prompt instead")
        if n:
            self.stats.hits += 1
            self.stats.tokens_saved += n
            setattr(self.stats, f"from_{source}", getattr(self.stats, f"from_{source}") + 1)

    def _best_donor(self, model: ModelBackend, slot: Slot, target: list[int],
                    max_keep: int) -> tuple[int, int] | None:
        if not model.kv_shareable:  # separate KV streams: a partial copy is not possible
            return None
        best = None
        for other in self.slots:
            if other is slot or not other.tokens or other.transferring:
                continue
            n = min(common_prefix(other.tokens, target), max_keep)
            if n and (best is None or n > best[1]) and prefix_intact(model, other.id, n):
                best = (other.id, n)
        return best

    def _save_if_losing(self, model: ModelBackend, slot: Slot, kept: int, shared: int, target: list[int]) -> None:
        """The slot is about to lose a part worth keeping: its state goes to RAM. Loading a state
        back costs a copy of a few KiB per token; recomputing a token costs a forward pass. Worth
        keeping: the next prompt shares less than half of the slot's tokens (llama-server's rule,
        ``f_keep < 0.5``, its common prefix over the slot's tokens), or at least SAVE_MIN_LOST of
        them are the slot's own (a conversation that shares a long system prompt with the next
        one). Both count what the next prompt shares (``shared``), not what a memory that cannot
        be cut back keeps of it (``kept``: a checkpoint's length), as llama-server does: what lies
        between comes back in the next prompt anyway. A slot that keeps nearly all (the next
        question on the same document, a retried turn, a short completion after one that began
        alike) is not copied out for a few tokens on every request: each such save copied the
        whole state (a 35B hybrid's recurrent part alone is tens of MiB, ~40–150 ms of page
        faults and copy on the project's 2-core machine kind) and left the RAM tier one more
        entry that every later lookup compares with its prompt.

        The newest of the slot's checkpoints that the next prompt will not keep go with the
        state (moved, not copied; ENTRY_CHECKPOINTS): the conversation's next prompt diverges a
        few tokens before this one's end, where only a checkpoint of a recurrent or window cache
        brings it back."""
        held = len(slot.tokens)
        lost = held - kept
        if self.host is None or not self.params.cache_prompt or lost < MIN_SHARED_PREFIX:
            return
        if 2 * shared >= held and held - shared < SAVE_MIN_LOST:
            return
        if -1 in slot.tokens:  # a restored state whose tokens we do not all know: not reusable
            return
        size = model.state_seq_size(slot.id)
        entry_bytes = size + 4 * held
        if not self.host.fits(entry_bytes):  # before copying it out
            self.host.stats.refused += 1
            return
        leaving = [c for c in self.checkpoints.per_slot.get(slot.id, ())
                   if not (c.n <= kept and target[:c.n] == c.tokens)]
        leaving = leaving[max(0, len(leaving) - ENTRY_CHECKPOINTS):]
        if not self.host.fits(entry_bytes + sum(len(c.state) for c in leaving)):
            leaving = []
        # llama.cpp writes the state straight into the buffer the entry keeps, not zeroed first:
        # no pass over it but llama.cpp's on the way to the next request's prefill (a long
        # prompt's state is tens of MiB)
        buf = np.empty(size, dtype=np.uint8)
        state = memoryview(buf)[:model.state_seq_get_into(slot.id, buf)]
        if self.host.put(self.model_key, slot.tokens, state, pos_min=model.seq_pos_min(slot.id), n_swa=model.n_swa,
                         recurrent=model.recurrent, checkpoints=leaving):
            self.checkpoints.hand_over(slot.id, leaving)

    def _keep_own(self, model: ModelBackend, slot: Slot, target: list[int], own: int, max_keep: int) -> int:
        n = own
        if self.params.cache_reuse > 0 and own < len(slot.tokens) and model.can_shift:
            moves, n = plan_chunk_reuse(slot.tokens, target, own, self.params.cache_reuse)
            for head_c, head_p, size in moves:
                model.seq_rm(slot.id, head_p, head_c)
                model.seq_add(slot.id, head_c, head_c + size, head_p - head_c)
            self.stats.chunks_shifted += len(moves)
            n = min(n, max_keep)
        if n < len(slot.tokens) and not model.seq_rm(slot.id, n, -1):
            return self._clear(model, slot)  # a memory that cannot be cut back: compute it all
        return n

    def _clear(self, model: ModelBackend, slot: Slot) -> int:
        model.seq_clear(slot.id)
        self.checkpoints.forget(slot.id)
        return 0

    def _restore(self, model: ModelBackend, slot: Slot, entry: CachedPrompt, n: int) -> int:
        """Load a RAM-tier entry into the slot, cut back to ``n`` tokens: by its own cells, or
        by the checkpoint at ``n`` it carries (``HostCache.best`` chose one of the two)."""
        try:
            restore_state(model, slot.id, entry.state)
        except Exception as e:  # not the client's doing: the prompt is computed instead
            log.warning("the RAM tier's state for slot %d was refused (%s); computing the prompt", slot.id, e)
            return self._clear(model, slot)
        if entry.serves_all_of(n, model.n_swa, model.recurrent):
            model.seq_rm(slot.id, n, -1)
            if not prefix_intact(model, slot.id, n):
                return self._clear(model, slot)
        else:
            ckpt = entry.checkpoint_at(n)
            if ckpt is None or not self.checkpoints.restore(model, slot.id, ckpt):
                return self._clear(model, slot)
        self.checkpoints.adopt(slot.id, [c for c in entry.checkpoints if c.n <= n])
        return n


def prefix_intact(model: ModelBackend, seq: int, n: int) -> bool:
    """Does ``seq`` hold every cell a token at position ``n`` attends to?

    All of ``[0, n)`` for full attention; from ``n - n_swa + 1`` on for a sliding window
    (llama.cpp reuses the cells of positions that fell out of the window); a recurrent state
    is the state after its last token, so it serves exactly the prefix it holds.
    """
    if n <= 0:
        return True
    pos_max = model.seq_pos_max(seq)
    if model.recurrent:  # no pos_min: llama.cpp walks every cell for it (~20 µs of an admission)
        return pos_max == n - 1
    if pos_max < n - 1:
        return False
    pos_min = model.seq_pos_min(seq)
    return pos_min >= 0 and serves(pos_min, n, model.n_swa)


def plan_chunk_reuse(cached: list[int], prompt: list[int], n_past: int,
                     min_chunk: int) -> tuple[list[tuple[int, int, int]], int]:
    """llama-server's ``--cache-reuse`` walk: after the common prefix, find chunks of at least
    ``min_chunk`` cached tokens that match the prompt where it continues, skipping cached
    tokens that do not. Returns the moves ``(cache pos, prompt pos, length)`` — each one is
    ``seq_rm(prompt pos, cache pos)`` then ``seq_add`` by ``prompt pos - cache pos`` — and
    the prompt tokens then held."""
    head_c = head_p = n_past
    moves: list[tuple[int, int, int]] = []
    while head_c < len(cached) and head_p < len(prompt):
        n = 0
        while (head_c + n < len(cached) and head_p + n < len(prompt)
               and cached[head_c + n] == prompt[head_p + n]):
            n += 1
        if n >= min_chunk:
            moves.append((head_c, head_p, n))
            head_c += n
            head_p += n
        else:
            head_c += 1
    return moves, head_p

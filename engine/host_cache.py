"""The host-memory tier of the prompt cache: sequence states kept in RAM, LRU, bounded in bytes.

When a slot is about to be reused by another conversation, its sequence state (what
``state_seq_get`` writes) and its tokens are kept here; when a request comes back whose
prompt starts with those tokens, the state is loaded into its slot instead of recomputing
the prefix. llama-server's ``--cache-ram`` host prompt cache works the same way (an entry
is moved back into a slot, not copied; an entry that is a prefix of a newer one is dropped).

Every entry is stamped with the key of the model instance that made it (``model_key``): a
state is only meaningful for the model, KV types and context layout that wrote it, so a
lookup never matches another key, and installing a new model drops every entry of the old.

An entry also records the first position its state holds cells for (``pos_min``): with a
sliding-window attention of ``n_swa`` positions the cache forgets older cells, so a prefix of
``n`` tokens of an entry is only usable when the entry still has the cells from
``n - n_swa + 1`` on (``serves``). Without a window every cell is kept and ``pos_min`` is 0.
A recurrent or hybrid model's state is that of its last token: an entry serves all its
tokens, or the prefix of one of the context checkpoints it carries (``checkpoints``: the
slot's, handed over with its state, as llama-server's cache keeps them). A chat template
re-renders the assistant's last turn, so an agent's next prompt diverges a few tokens before
its previous prompt's end: only a checkpoint there brings the conversation back.

With a disk tier (``engine.disk_tier``), an entry the RAM limit evicts is written to files
(its state and its checkpoints) instead of dropped, under a limit of as many bytes again;
lookups see both tiers. The checkpoints go along because without them the tier would serve
an agent nothing: its next prompt never extends the saved tokens.

Used from the inference thread only (admission happens there); the loop reads the counters.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable

from .checkpoints import Checkpoint
from .disk_tier import DiskTier

MIB = 1 << 20


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n and a[n - 1] == b[n - 1] and a[:n] == b[:n]:  # a continuation: one compare at C speed
        return n
    window = _parting_window(a, b, n)
    if window is None:
        return n
    lo, hi = window
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _parting_window(a: list[int], b: list[int], n: int) -> tuple[int, int] | None:
    """None when ``a`` and ``b`` share their first ``n`` tokens, else ``(lo, hi)``: they share
    the first ``lo`` and part before ``hi``. Slice equality runs at C speed: windows that
    double from the start find where they part with copies about as long as the common
    prefix (two prompts that part a few tokens in cost a few tokens, not ``n``)."""
    lo, hi = 0, min(n, 16)
    while a[lo:hi] == b[lo:hi]:
        if hi == n:
            return None
        lo, hi = hi, min(n, 2 * hi)
    return lo, hi


def _shares(a: list[int], b: list[int], k: int) -> bool:
    """Do ``a`` and ``b`` both start with the same ``k`` tokens? The k-th token first, then
    from the start: prompts that end alike (a chat template's last turn, documents of one
    length) but part early are turned away after a few tokens (a put or a lookup asks every
    entry of the RAM tier)."""
    if k <= 0:
        return True
    return len(a) >= k and len(b) >= k and a[k - 1] == b[k - 1] and _parting_window(a, b, k) is None


def serves(pos_min: int, n: int, n_swa: int, held: int | None = None) -> bool:
    """Do cells from ``pos_min`` on let a token at position ``n`` attend to all it needs?
    ``held``: the tokens of a recurrent state, which serves only all of them."""
    if held is not None:
        return n == held
    return n <= 0 or pos_min <= (max(0, n - n_swa + 1) if n_swa > 0 else 0)


@dataclass
class CachedPrompt:
    model_key: Hashable
    tokens: list[int]
    state: bytes | memoryview
    pos_min: int = 0
    size: int = 0  # bytes it takes (state + tokens + checkpoints), in RAM or on disk
    paths: list[Path] = field(default_factory=list)  # on the disk tier: the state's file, then the checkpoints'
    checkpoints: list[Checkpoint] = field(default_factory=list)  # prefixes of ``tokens``, shortest first

    def __post_init__(self) -> None:
        self.size = self.size or memoryview(self.state).nbytes + 4 * len(self.tokens) + \
            sum(len(c.state) for c in self.checkpoints)

    def serves_all_of(self, n: int, n_swa: int, recurrent: bool) -> bool:
        """Does the state itself serve its first ``n`` tokens (no checkpoint needed)?"""
        return serves(self.pos_min, n, n_swa, len(self.tokens) if recurrent else None)

    def usable(self, n: int, n_swa: int, recurrent: bool) -> int:
        """How much of a common prefix of ``n`` tokens this entry can put in a slot: all of
        it when its cells serve it, else the longest checkpoint within it, else nothing."""
        if self.serves_all_of(n, n_swa, recurrent):
            return n
        return max((c.n for c in self.checkpoints if c.n <= n), default=0)

    def recurrent_prefix(self, tokens: list[int], at_least: int = 1) -> int:
        """:meth:`usable` of the prefix a recurrent entry shares with ``tokens`` when that is at
        least ``at_least`` tokens, else 0. Its state serves only its whole length or a
        checkpoint's: those few lengths are asked, each from its last token on, instead of
        comparing the common prefix (the fleet's agents share a system prompt of thousands of
        tokens, and every entry of theirs would be compared over all of it on every lookup)."""
        for n in (len(self.tokens), *(c.n for c in reversed(self.checkpoints))):  # longest first
            if n < at_least:
                return 0
            if _shares(self.tokens, tokens, n):
                return n
        return 0

    def checkpoint_at(self, n: int) -> Checkpoint | None:
        return next((c for c in self.checkpoints if c.n == n), None)


@dataclass
class HostCacheStats:
    saves: int = 0  # states put in
    restores: int = 0  # states loaded back into a slot
    evictions: int = 0  # entries dropped to make room
    invalidated: int = 0  # entries dropped because their model was replaced
    refused: int = 0  # states larger than the whole limit
    spilled: int = 0  # evicted from RAM to the disk tier
    disk_restores: int = 0  # of the restores, those read back from the disk tier


@dataclass
class HostCache:
    """``limit_bytes`` None: no limit (llama-server's ``--cache-ram -1``)."""

    limit_bytes: int | None
    disk: DiskTier | None = None
    entries: "OrderedDict[int, CachedPrompt]" = field(default_factory=OrderedDict)  # RAM, oldest first
    spilled: "OrderedDict[int, CachedPrompt]" = field(default_factory=OrderedDict)  # disk, oldest first
    n_bytes: int = 0
    disk_bytes: int = 0
    stats: HostCacheStats = field(default_factory=HostCacheStats)
    _next_id: int = 0

    def __len__(self) -> int:
        return len(self.entries)

    def fits(self, size: int) -> bool:
        """Could an entry of ``size`` bytes be kept at all (after evicting everything else)?"""
        return self.limit_bytes is None or size <= self.limit_bytes

    def best(self, model_key: Hashable, tokens: list[int], n_swa: int = 0,
             recurrent: bool = False, at_least: int = 1) -> tuple[int, int] | None:
        """(entry id, common prefix length) of the entry of ``model_key`` that gives the longest
        usable prefix of ``tokens``, of ``at_least`` tokens; None when none gives that many.

        Every request looks here, and the tier may hold thousands of entries: an entry that
        cannot beat the best so far (most of them) is turned away by comparing one token, the
        last one it would have to share (a recurrent one: :meth:`CachedPrompt.recurrent_prefix`)."""
        best: tuple[int, int] | None = None
        for eid, e in [*self.entries.items(), *self.spilled.items()]:
            if e.model_key != model_key:
                continue
            k = at_least if best is None else max(at_least, best[1] + 1)
            if recurrent:
                n = e.recurrent_prefix(tokens, k)
            elif _shares(e.tokens, tokens, k):
                n = e.usable(common_prefix(e.tokens, tokens), n_swa, recurrent)
            else:
                continue
            if n >= k:
                best = (eid, n)
        return best

    def take(self, eid: int) -> CachedPrompt:
        """Remove an entry and hand it over (its state goes into a slot). OSError: its file is gone."""
        self.stats.restores += 1
        if eid in self.entries:
            e = self.entries.pop(eid)
            self.n_bytes -= e.size
            return e
        e = self.spilled.pop(eid)
        self.disk_bytes -= e.size
        self.stats.disk_restores += 1
        try:
            e.state = self.disk.read(e.paths[0], len(e.tokens), mapped=True)
            for c, path in zip(e.checkpoints, e.paths[1:]):
                c.state = self.disk.read(path, c.n)
        finally:
            self.disk.remove(e.paths)
            e.paths = []
        return e

    def put(self, model_key: Hashable, tokens: list[int], state: bytes | memoryview, pos_min: int = 0,
            n_swa: int = 0, recurrent: bool = False, checkpoints: list[Checkpoint] | None = None) -> bool:
        """Keep a state and the slot's ``checkpoints`` (held as given: the caller hands them
        over); False when it is not kept (already held, or larger than the limit)."""
        entry = CachedPrompt(model_key, list(tokens), state, pos_min, checkpoints=list(checkpoints or ()))
        for e in [*self.entries.values(), *self.spilled.values()]:
            if (e.model_key == model_key and _shares(e.tokens, tokens, len(tokens))
                    and serves(e.pos_min, len(tokens), n_swa, len(e.tokens) if recurrent else None)):
                return False  # an entry holding these tokens (and maybe more) serves them already
        if not self.fits(entry.size):
            self.stats.refused += 1
            return False
        for eid, e in [*self.entries.items(), *self.spilled.items()]:
            if (e.model_key == model_key and _shares(tokens, e.tokens, len(e.tokens))
                    and serves(pos_min, len(e.tokens), n_swa, len(tokens) if recurrent else None)):
                self._drop(eid)  # the new entry serves everything this one did: obsolete
        while self.limit_bytes is not None and self.entries and self.n_bytes + entry.size > self.limit_bytes:
            self._spill(next(iter(self.entries)))
        self._next_id += 1
        self.entries[self._next_id] = entry
        self.n_bytes += entry.size
        self.stats.saves += 1
        return True

    def keep_only(self, model_key: Hashable) -> None:
        """A new model is live: entries of any other are useless (and must never be loaded)."""
        for eid, e in [*self.entries.items(), *self.spilled.items()]:
            if e.model_key != model_key:
                self._drop(eid)
                self.stats.invalidated += 1

    def close(self) -> None:
        """Forget everything; the disk tier's files go too."""
        self.entries.clear()
        self.spilled.clear()
        self.n_bytes = self.disk_bytes = 0
        if self.disk is not None:
            self.disk.close()

    def _spill(self, eid: int) -> None:
        """Make room in RAM: the oldest entry goes to the disk tier (if any), else away."""
        e = self.entries[eid]
        self._drop(eid)
        self.stats.evictions += 1
        if self.disk is None:
            return
        while self.spilled and self.disk_bytes + e.size > self.limit_bytes:
            self._drop(next(iter(self.spilled)))
        try:
            e.paths = self.disk.write(e.tokens, e.state, e.checkpoints)
        except OSError:  # a full disk costs the entry, nothing else
            return
        e.state = b""
        for c in e.checkpoints:  # their prefixes stay in RAM: lookups ask them
            c.state = b""
        self.spilled[eid] = e
        self.disk_bytes += e.size
        self.stats.spilled += 1

    def _drop(self, eid: int) -> None:
        if eid in self.entries:
            self.n_bytes -= self.entries.pop(eid).size
        else:
            e = self.spilled.pop(eid)
            self.disk_bytes -= e.size
            self.disk.remove(e.paths)


def limit_from_mib(mib: int) -> int | None:
    """llama-server's ``--cache-ram`` value: -1 no limit, 0 off (never called), N MiB."""
    return None if mib < 0 else mib * MIB

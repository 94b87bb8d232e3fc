"""A scripted ``ModelBackend`` for step-by-step engine tests (no model, no wall clock).

Tokens are bytes: byte ``b`` is token ``b + 3``; 1 is BOS, 2 is EOS. "Decoding" appends the
fed tokens to the sequence's KV list; the next token is ``script(kv)`` — by default the
letters a..z in turn. A position without a cell holds ``HOLE`` (removed by a ``seq_rm`` in
the middle, or forgotten by a sliding window of ``n_swa``); a decode whose tokens would
attend to a hole fails, so a test sees any reuse of a prefix whose cells are gone. A
sequence's state is its token list as bytes, stamped with the serial number of the model
that made it. ``Gate``s let a test hold a decode step or a model build on its thread until it
lets go — all at once (``open``) or exactly ``n`` at a time (``release(n)``: step mode) — and
await that something is held there (``wait_held``). A ``Signal`` wakes the asyncio tasks that
wait for a condition whenever something it depends on changes, from any thread: the gates,
builds and closes of a factory notify its ``changed`` signal (``tests.engine_env`` adds the
actor's own events), so tests wait for events, with a deadline, instead of polling.
"""
from __future__ import annotations

import asyncio
import itertools
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from engine.backend import BatchItem
from engine.chat.formats import detect_format
from engine.jobs import KvCacheFull
from engine.kv_cache import KvCacheInfo
from engine.model_params import ModelParams
from engine.sampling import SamplerParams
from tests.signals import Signal

BOS, EOS, FIRST_BYTE = 1, 2, 3
HOLE = -2  # a position whose cell is gone
N_VOCAB = 256 + FIRST_BYTE
STATE_MAGIC = b"SCRIPTED"


_serials = itertools.count(1)
_STATE_HEAD = len(STATE_MAGIC) + 8


def parse_state(raw: bytes) -> tuple[int, list[int]]:
    """(serial of the model that produced it, tokens); ValueError for anything else."""
    if raw[:len(STATE_MAGIC)] != STATE_MAGIC or len(raw) < _STATE_HEAD:
        raise ValueError("not a scripted state")
    serial, n = struct.unpack_from("<II", raw, len(STATE_MAGIC))
    if len(raw) != _STATE_HEAD + 4 * n:
        raise ValueError("scripted state of the wrong length")
    return serial, list(struct.unpack_from(f"<{n}i", raw, _STATE_HEAD))


def letters(kv: list[int]) -> int:
    """The default script: a, b, c, … z, a, … by position."""
    return FIRST_BYTE + ord("a") + len(kv) % 26


class Gate:
    """Holds the threads that pass it while closed; ``release(n)`` lets exactly ``n`` more of
    them through (step mode), ``open`` all. Counts who waits and who passed; every change
    notifies ``changed``, so ``await gate.wait_held()`` needs no polling."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._credits = 0  # passes released while closed, not taken yet
        self.waiting = 0
        self.passed = 0
        self.changed = Signal()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def held(self) -> int:
        """Threads held here that no release has let go yet."""
        with self._cond:
            return max(0, self.waiting - self._credits) if self._closed else 0

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self.changed.notify()

    def open(self) -> None:
        with self._cond:
            self._closed, self._credits = False, 0
            self._cond.notify_all()
        self.changed.notify()

    def release(self, n: int = 1) -> None:
        """Let exactly ``n`` held (or next) threads through a closed gate."""
        with self._cond:
            self._credits += n
            self._cond.notify(n)
        self.changed.notify()

    def pass_through(self) -> None:
        with self._cond:
            self.waiting += 1
            self.changed.notify()
            try:  # 60 s: a safety net for a broken test, never a timing assumption
                if not self._cond.wait_for(lambda: not self._closed or self._credits > 0, 60):
                    raise RuntimeError("gate left closed")
                if self._closed:
                    self._credits -= 1
            finally:
                self.waiting -= 1
                self.passed += 1
        self.changed.notify()

    async def wait_held(self, n: int = 1, what: str = "a thread held at the gate") -> None:
        """Until ``n`` threads are held here (a build started, a decode step waits)."""
        await self.changed.wait_for(lambda: self.held >= n, what)


@dataclass
class ScriptedSampler:
    params: SamplerParams
    freed: bool = False

    def free(self) -> None:
        self.freed = True


class ScriptedBackend:
    def __init__(self, params: ModelParams, script: Callable[[list[int]], int], decode_gate: Gate,
                 n_swa: int = 0, kv_shareable: bool = True, changed: Signal | None = None):
        self.params = params
        self.changed = changed  # notified when the model is closed
        self.n_swa = n_swa
        self.kv_shareable = kv_shareable
        self.can_shift = n_swa == 0
        self.recurrent = False
        self.script = script
        self.decode_gate = decode_gate
        self.serial = next(_serials)  # written into every state it produces: which model made it
        self.kv: list[list[int]] = [[] for _ in range(params.n_slots)]
        self.batches: list[list[tuple[int, int]]] = []  # per decode: (seq, n_tokens) of each item
        self.samplers: list[ScriptedSampler] = []
        self.closed = False
        self._with_logits: set[int] = set()
        self.given_logits: list[int] = []  # seqs set_logits was called for, in order
        self.kv_cells: int | None = None  # a unified cache of this many cells: a batch past it finds no room

    # ---- identity and vocabulary
    @property
    def n_vocab(self) -> int:
        return N_VOCAB

    @property
    def n_batch(self) -> int:
        return self.params.n_batch

    @property
    def n_ubatch(self) -> int:
        return min(self.params.n_batch, 512)

    @property
    def bos(self) -> int:
        return BOS

    @property
    def kv_cache(self) -> KvCacheInfo:
        """No layout: scripted states are not llama.cpp's; a slot holds ``n_ctx`` tokens, or
        its share of them without a unified cache (no padding: tests count exact limits)."""
        p = self.params
        return KvCacheInfo(p.cache_type_k, p.cache_type_v, p.flash_attn, p.kv_unified, p.n_ctx,
                           p.n_ctx if p.kv_unified else p.n_ctx // p.n_slots, state_growth=(_STATE_HEAD + 4, 4))

    @property
    def identity(self) -> dict[str, Any]:
        return {"model_path": self.params.model_path, "model_name": self.params.model_path,
                "tokenizer": f"bytes/{N_VOCAB}", "model_quant": "F32", "model_capabilities": 0}

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode() if isinstance(text, str) else bytes(text)
        return ([BOS] if add_special else []) + [b + FIRST_BYTE for b in data]

    def chat_tokens(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.chat_text_tokens(self.render_chat(messages))

    chat_syntax = detect_format(None)
    user_turn_tokens: list[int] = []  # this format's turns are not marked by special tokens
    tool_result_turns = 0

    def render_chat(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        return "".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages) + "assistant: "

    def chat_text_tokens(self, text: str) -> list[int]:
        return self.tokenize(text)

    def token_to_piece(self, tok: int, special: bool = False) -> bytes:
        return bytes([tok - FIRST_BYTE]) if tok >= FIRST_BYTE else b""

    def is_eog(self, tok: int) -> bool:
        return tok == EOS

    # ---- the step
    n_threads = 2
    threads_now: int | None = None  # what the engine last asked for (None: never)

    def set_threads(self, n: int) -> None:
        self.threads_now = n

    def decode(self, items: Sequence[BatchItem]) -> None:
        self._check_open()
        self.decode_gate.pass_through()
        n_tokens = sum(len(it.tokens) for it in items)
        if n_tokens > self.n_batch:  # llama.cpp's batch holds n_batch tokens
            raise ValueError(f"{n_tokens} tokens in one decode exceed n_batch={self.n_batch}")
        if self.kv_cells is not None and sum(map(len, self.kv)) + n_tokens > self.kv_cells:
            raise KvCacheFull(f"{n_tokens} tokens do not fit the {self.kv_cells} cells")  # nothing changed
        self._with_logits = set()
        for it in items:
            kv = self.kv[it.seq]
            if it.pos0 != len(kv):
                raise ValueError(f"seq {it.seq}: token at pos {it.pos0} but the KV holds {len(kv)}")
            window = kv[max(0, it.pos0 - self.n_swa + 1):] if self.n_swa else kv
            if HOLE in window:
                raise ValueError(f"seq {it.seq}: a token at pos {it.pos0} would attend to a missing cell")
            kv.extend(it.tokens)
            if self.n_swa:  # the cells that left the window are reused: gone
                for p in range(max(0, len(kv) - self.n_swa + 1)):
                    kv[p] = HOLE
            if it.logits_last:
                self._with_logits.add(it.seq)
        self.batches.append([(it.seq, len(it.tokens)) for it in items])

    def set_logits(self, seq: int, row: np.ndarray) -> None:
        """The script decides every token, so the row only makes ``seq``'s logits available."""
        self._check_open()
        self.given_logits.append(seq)
        self._with_logits.add(seq)

    def logits(self, seq: int) -> np.ndarray:
        self._require_logits(seq)
        row = np.zeros(N_VOCAB, dtype=np.float32)
        row[self.script(self.kv[seq])] = 1.0
        return row

    def make_sampler(self, params: SamplerParams | None = None) -> ScriptedSampler:
        s = ScriptedSampler(params or SamplerParams())
        self.samplers.append(s)
        return s

    def accept(self, sampler: ScriptedSampler, tok: int) -> None:
        if sampler.freed:
            raise RuntimeError("sampler was freed")

    def top_logprobs(self, seq: int, n: int) -> list[tuple[int, float]]:
        return [(self.script(self.kv[seq]), 0.0)][:n]

    def sample(self, seq: int, sampler: ScriptedSampler, want_logprob: bool = False) -> Any:
        self._require_logits(seq)
        if sampler.freed:
            raise RuntimeError("sampler was freed")
        tok = self.script(self.kv[seq])
        return (tok, 0.0) if want_logprob else tok

    # ---- sequences and state
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        kv = self.kv[seq]
        p0 = max(p0, 0)
        if p1 < 0 or p1 >= len(kv):
            del kv[p0:]
        else:
            kv[p0:p1] = [HOLE] * max(0, p1 - p0)
        self._trim(seq)
        return True

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        if not self.can_shift:
            raise RuntimeError("this KV cache cannot shift")
        kv = self.kv[seq]
        moved = kv[p0:p1]
        kv[p0:p1] = [HOLE] * len(moved)
        if any(t != HOLE for t in kv[p0 + delta:p1 + delta]):
            raise ValueError(f"seq {seq}: shifting [{p0}, {p1}) by {delta} lands on cells in use")
        kv[p0 + delta:p0 + delta + len(moved)] = moved
        self._trim(seq)

    def seq_copy_prefix(self, src: int, dst: int, n: int) -> None:
        if not self.kv_shareable:
            raise RuntimeError("a partial sequence copy needs a unified KV cache")
        if self.kv[dst]:
            raise ValueError(f"seq {dst} is not empty")
        self.kv[dst] = self.kv[src][:n]
        self._trim(dst)

    def seq_clear(self, seq: int) -> None:
        self.kv[seq] = []

    def seq_pos_max(self, seq: int) -> int:
        return len(self.kv[seq]) - 1

    def seq_pos_min(self, seq: int) -> int:
        return next((p for p, t in enumerate(self.kv[seq]) if t != HOLE), -1)

    def _trim(self, seq: int) -> None:
        kv = self.kv[seq]
        while kv and kv[-1] == HOLE:
            kv.pop()

    def state_seq_size(self, seq: int) -> int:
        return _STATE_HEAD + 4 * len(self.kv[seq])

    def state_seq_get(self, seq: int) -> bytes:
        kv = self.kv[seq]
        return STATE_MAGIC + struct.pack(f"<II{len(kv)}i", self.serial, len(kv), *kv)

    def state_seq_get_into(self, seq: int, buf: bytearray | memoryview) -> int:
        data = self.state_seq_get(seq)
        memoryview(buf).cast("B")[:len(data)] = data
        return len(data)

    def state_seq_set(self, seq: int, data: bytes | bytearray | memoryview) -> int:
        """Like llama.cpp: reads the state its header describes, returns the bytes it read (what
        follows — a logits tail — is the caller's)."""
        raw = bytes(data)
        n = struct.unpack_from("<I", raw, len(STATE_MAGIC) + 4)[0] if len(raw) >= _STATE_HEAD else 0
        used = raw[:_STATE_HEAD + 4 * n]
        self.kv[seq] = []
        _, self.kv[seq] = parse_state(used)
        return len(used)

    def checkpoint_get(self, seq: int, reuse: bytearray | None = None) -> bytes:
        return self.state_seq_get(seq)  # scripted states are small: the whole of it

    def checkpoint_set(self, seq: int, data: bytes) -> bool:
        self.state_seq_set(seq, data)
        return True

    def close(self) -> None:
        self.closed = True
        if self.changed is not None:
            self.changed.notify()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("model is closed")

    def _require_logits(self, seq: int) -> None:
        self._check_open()
        if seq not in self._with_logits:
            raise RuntimeError(f"no logits for seq {seq}")


@dataclass
class ScriptedFactory:
    """Builds ScriptedBackends. ``fail`` names model paths whose build raises."""

    script: Callable[[list[int]], int] = letters
    fail: set[str] = field(default_factory=set)
    n_swa: int = 0  # a sliding window: cells older than this many positions are forgotten
    kv_shareable: bool = True  # one KV buffer: partial sequence copies possible
    decode_gate: Gate = field(default_factory=Gate)
    build_gate: Gate = field(default_factory=Gate)
    built: list[ScriptedBackend] = field(default_factory=list)
    # notified by both gates, by every build that returns and by every model closed
    changed: Signal = field(default_factory=Signal)

    def __post_init__(self) -> None:
        self.decode_gate.changed.forward.append(self.changed)
        self.build_gate.changed.forward.append(self.changed)

    def check(self) -> None:
        pass

    def build(self, params: ModelParams, progress: Callable[[float], None] | None = None) -> ScriptedBackend:
        if progress is not None:
            progress(0.5)  # a build held at the gate shows a load half done
        self.build_gate.pass_through()
        try:
            if params.model_path in self.fail:
                raise RuntimeError(f"cannot load {params.model_path}")
            model = ScriptedBackend(params, self.script, self.decode_gate, self.n_swa, self.kv_shareable,
                                    self.changed)
            self.built.append(model)
            return model
        finally:
            self.changed.notify()

    def devices(self, params: ModelParams) -> list[str]:
        return ["CPU"]


@dataclass
class _Timer:
    delay: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualTimers:
    """``EngineConfig.call_later`` whose timers fire only when the test says so."""

    def __init__(self) -> None:
        self.timers: list[_Timer] = []

    def __call__(self, delay: float, callback: Callable[[], None]) -> _Timer:
        t = _Timer(delay, callback)
        self.timers.append(t)
        return t

    def fire(self) -> int:
        """Fire every pending timer; returns how many fired."""
        due = [t for t in self.timers if not t.cancelled]
        self.timers = []
        for t in due:
            t.callback()
        return len(due)


async def until(predicate: Callable[[], bool], what: str = "condition", timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it holds, for what no event announces (another process, the
    GC, a thread outside the engine); engine steps and builds have events (``tests.engine_env``:
    ``Env.step``, ``Env.wait_for``; ``Gate.wait_held``). First a burst of bare yields (what the
    loop's own tasks do settles there), then 1 ms sleeps (another thread has to run); the
    deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    yields = 0
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        yields += 1
        await asyncio.sleep(0 if yields <= 64 else 0.001)

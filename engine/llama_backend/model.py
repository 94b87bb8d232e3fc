"""``LoadedModel``: one llama.cpp model plus one context of ``n_seq_max`` sequences (slots).

Everything here blocks; ctypes releases the GIL during every foreign call, so the event
loop keeps running while ``llama_decode`` computes. Drive one model from ONE thread (the
engine's inference thread). Built against llama-cpp-python 0.3.36 (llama.cpp's
``llama_memory_*`` API; the old ``llama_kv_self_*`` functions no longer exist).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence, overload

import numpy as np

import llama_cpp.llama_cpp as L

from ..backend import BatchItem
from ..buffers import Buffer
from ..kv_cache import KvCacheInfo
from ..sampling import SamplerParams
from . import seq_state
from .batch import LlamaBatch
from .context import context_params, create_context, load_model_file, slot_context_size
from .identity import read_identity
from .kv_probe import describe
from .model_text import ModelText
from .runtime import (ContextExceeded, DecodeError, LlamaBackendError, clear_llama_errors, decode_error_message,
                      default_threads)
from .sampler import Sampler, SpareChains, accept_forced, make_sampler, sample_row, top_logprobs


class LoadedModel(ModelText):
    """``n_ctx`` is the total context, ``n_seq_max`` the slots; with ``kv_unified`` (the
    default) the sequences share ``n_ctx`` cells and each may grow up to ``n_ctx`` tokens as
    long as the total fits, without it each gets ``n_ctx / n_seq_max`` (llama.cpp's rule; a
    slot's limit is :attr:`n_ctx_slot`). ``before_context`` sees the loaded model before the
    context is allocated and may refuse it by raising. ``llama_env``: the environment llama.cpp
    reads, as the engine's configuration captured it (``EngineConfig.llama_env``; None: this
    process's); the KV cache's description follows it.

    Implements :class:`engine.backend.ModelBackend` (tokens and chat: :class:`ModelText`).
    Not thread-safe.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        n_ctx: int = 4096,
        n_seq_max: int = 4,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        extra_model_params: dict[str, Any] | None = None,
        extra_ctx_params: dict[str, Any] | None = None,
        kv_unified: bool = True,
        n_threads_batch: int | None = None,
        n_ctx_slot_cap: int = 0,
        chat_template: str | None = None,
        jinja: bool = True,
        chat_kwargs: dict[str, Any] | None = None,
        before_context: Callable[[Any], None] | None = None,
        progress: Callable[[float], None] | None = None,
        llama_env: Mapping[str, str] | None = None,
    ) -> None:
        self._model = None
        self._ctx = None
        self._batch: LlamaBatch | None = None
        self._rows: dict[int, np.ndarray] = {}  # views of llama.cpp's logits rows, by address (_row)
        self._closed = False
        self.spare_chains = SpareChains()  # sampler chains kept between jobs (sampler.SpareChains)
        self._kv_cache: KvCacheInfo | None = None
        self._llama_env = llama_env
        self.tensor_overrides: tuple[dict[str, Any], ...] = ()  # what -ot / --n-cpu-moe moved (build.load)
        self.gpu_offload: Any = None  # engine.gpu.Offload: where the layers went (build.load)
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        self.model_path = path
        self._model = load_model_file(path, n_gpu_layers, extra_model_params, progress)
        try:
            if before_context is not None:
                before_context(self._model)
            nt = int(n_threads) if n_threads and n_threads > 0 else default_threads()
            self.cparams = context_params(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_threads=nt,
                                          n_threads_batch=n_threads_batch, kv_unified=kv_unified,
                                          extra=extra_ctx_params)
            self._ctx = create_context(self._model, self.cparams, path)
            self._read_context(nt, n_ctx_slot_cap)
            self._identity = read_identity(self._model, self._vocab, path, self._n_vocab)
            self._init_text(self._model, chat_template, jinja, chat_kwargs, self._identity["architecture"])
        except BaseException:
            self.close()
            raise

    def _read_context(self, n_threads: int, n_ctx_slot_cap: int) -> None:
        """What the new context settled on (llama.cpp pads and caps what was asked)."""
        ctx, model = self._ctx, self._model
        self._mem = L.llama_get_memory(ctx)
        self._vocab = L.llama_model_get_vocab(model)
        self._n_vocab = int(L.llama_vocab_n_tokens(self._vocab))
        self._row_type = ctypes.c_float * self._n_vocab  # a logits row, as ctypes sees it
        self._n_ctx = int(L.llama_n_ctx(ctx))
        self._n_batch, self._n_ubatch = int(L.llama_n_batch(ctx)), int(L.llama_n_ubatch(ctx))
        self._n_seq_max = int(L.llama_n_seq_max(ctx))
        self._n_ctx_slot = slot_context_size(ctx, model, n_ctx_slot_cap)
        self.n_threads = self._threads_now = n_threads
        # one reusable batch: n_batch tokens, each with room for n_seq_max seq ids
        self._batch = LlamaBatch(self._n_batch, self._n_seq_max)
        self._logit_idx: dict[int, int] = {}  # seq -> output row of the last decode; < 0: a set_logits row
        self._given_rows: dict[int, np.ndarray] = {}  # set_logits rows, until the next decode

    # ---- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Free the batch, the context and the model. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._rows.clear()
        self.spare_chains.close()
        if self._batch is not None:
            self._batch.free()
            self._batch = None
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            L.llama_model_free(self._model)
            self._model = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def _ctx_handle(self) -> Any:
        if self._ctx is None:
            raise LlamaBackendError("model is closed")
        return self._ctx

    # ---- properties --------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        """The model's repeating layers (llama.cpp offloads n_layer + 1: the output layer too)."""
        return int(L.llama_model_n_layer(self._model))

    @property
    def n_ctx(self) -> int:
        """KV cells of the context (shared by all sequences; the limit per sequence too)."""
        return self._n_ctx

    @property
    def n_seq_max(self) -> int:
        return self._n_seq_max

    @property
    def model_handle(self) -> Any:
        return self._model

    @property
    def kv_cache(self) -> KvCacheInfo:
        """The KV cache's configuration and layout (described on first use: this decodes one
        token, so the factory asks on the loader thread)."""
        if self._kv_cache is None:
            env = self._llama_env if self._llama_env is not None else os.environ
            self._kv_cache = describe(self, dict(env))
        return self._kv_cache

    @property
    def n_ctx_slot(self) -> int:
        """Tokens one sequence may hold: llama.cpp's per-sequence context, capped by
        ``n_ctx_slot_cap`` and the training context (llama-server's ``n_ctx_slot()``)."""
        return self._n_ctx_slot

    @property
    def n_batch(self) -> int:
        """Maximum number of tokens in one :meth:`decode` call."""
        return self._n_batch

    @property
    def n_ubatch(self) -> int:
        """Tokens llama.cpp computes in one pass (a :meth:`decode` of more is split)."""
        return self._n_ubatch

    @property
    def identity(self) -> dict[str, Any]:
        """See :func:`engine.llama_backend.identity.read_identity`."""
        return dict(self._identity)

    def set_threads(self, n: int) -> None:
        """Compute threads for the following decodes (prefill and generation alike)."""
        n = max(1, min(int(n), self.n_threads))
        if n != self._threads_now:
            L.llama_set_n_threads(self._ctx_handle(), n, n)
            self._threads_now = n

    # ---- sequences ---------------------------------------------------------------------
    def _check_seq(self, seq: int) -> int:
        if self._closed:
            raise LlamaBackendError("model is closed")
        seq = int(seq)
        if not 0 <= seq < self._n_seq_max:
            raise ValueError(f"seq {seq} out of range 0..{self._n_seq_max - 1}")
        return seq

    def seq_clear(self, seq: int) -> None:
        """Remove every cell of ``seq`` from the KV cache."""
        seq = self._check_seq(seq)
        L.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._logit_idx.pop(seq, None)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq`` (p0 < 0: from 0; p1 < 0: to the end).
        Returns False if a partial removal is impossible (e.g. recurrent models)."""
        seq = self._check_seq(seq)
        return bool(L.llama_memory_seq_rm(self._mem, seq, int(p0), int(p1)))

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Move positions [p0, p1) of ``seq`` by ``delta`` (K is re-roped on the next decode)."""
        L.llama_memory_seq_add(self._mem, self._check_seq(seq), int(p0), int(p1), int(delta))

    def clear_all(self) -> None:
        """Empty the whole KV cache (all sequences)."""
        self._ctx_handle()
        L.llama_memory_clear(self._mem, True)
        self._logit_idx.clear()

    def seq_pos_max(self, seq: int) -> int:
        """Largest position stored for ``seq`` (-1 if empty); the next token goes to +1."""
        return int(L.llama_memory_seq_pos_max(self._mem, self._check_seq(seq)))

    def seq_pos_min(self, seq: int) -> int:
        """Smallest position stored for ``seq`` (-1 if empty); above 0 once a sliding-window
        cache reused the cells of positions that left the window."""
        return int(L.llama_memory_seq_pos_min(self._mem, self._check_seq(seq)))

    def seq_copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give ``dst`` the cells of positions [0, n) of ``src``. With a unified KV cache the
        cells are shared (``dst`` is added to their sequence set); llama.cpp aborts on a
        partial copy across separate streams, hence the check."""
        src, dst = self._check_seq(src), self._check_seq(dst)
        if not self.kv_shareable:
            raise LlamaBackendError("a partial sequence copy needs a unified KV cache")
        L.llama_memory_seq_cp(self._mem, src, dst, 0, int(n))
        self._logit_idx.pop(dst, None)

    @property
    def kv_shareable(self) -> bool:
        # A sliding-window cache takes back a cell that left the window only while a single
        # sequence holds it (llama.cpp's find_slot): the cells of a prefix copied across slots
        # would stay until every holder dropped them, and fill the window's small cache until a
        # decode finds no cell (Gemma 3, four conversations on two slots). So no partial copies
        # there, unless the window cache is full size (--swa-full).
        return bool(self.cparams.kv_unified) and (self.n_swa == 0 or bool(self.cparams.swa_full))

    @property
    def can_shift(self) -> bool:
        return bool(L.llama_memory_can_shift(self._mem))

    @property
    def n_swa(self) -> int:
        return int(L.llama_model_n_swa(self._model)) if self._model is not None else 0

    @property
    def recurrent(self) -> bool:
        m = self._model
        return m is not None and bool(L.llama_model_is_recurrent(m) or L.llama_model_is_hybrid(m))

    def seq_copy(self, src: int, dst: int) -> None:
        """Make ``dst`` a copy of ``src`` (``dst`` is cleared first). Cheap with a unified KV cache."""
        src, dst = self._check_seq(src), self._check_seq(dst)
        if src == dst:
            return
        L.llama_memory_seq_rm(self._mem, dst, -1, -1)
        L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self._logit_idx.pop(dst, None)

    # ---- the batched step ----------------------------------------------------------------
    def decode(self, items: Sequence[BatchItem], keep_order: bool = False) -> None:
        """Decode the tokens of all ``items`` in ONE ``llama_decode`` call.

        Each item is one sequence (at most one item per sequence); its tokens get positions
        ``pos0, pos0+1, ...``. With ``logits_last`` the output row of its last token is kept
        for :meth:`logits` / :meth:`sample` until the next ``decode``. The total number of
        tokens must not exceed :attr:`n_batch` (chunk long prompts). Raises
        :class:`DecodeError` if llama.cpp rejects the batch or the context is full.
        """
        self._logit_idx = {}
        self._given_rows.clear()
        if not items:
            return
        ctx = self._ctx_handle()
        out = self._batch.fill(items, keep_order)  # keep_order: only to measure it (LlamaBatch.fill)
        clear_llama_errors()
        rc = int(L.llama_decode(ctx, self._batch.raw))
        if rc != 0:
            raise (ContextExceeded if rc == 1 else DecodeError)(rc, decode_error_message(rc, items, self.seq_pos_max))
        self._logit_idx = out

    def _logits_index(self, seq: int) -> int:
        try:
            return self._logit_idx[seq]
        except KeyError:
            raise LlamaBackendError(
                f"no logits for seq {seq}: the last decode() had no logits_last item for it"
            ) from None

    def _row(self, idx: int) -> np.ndarray:
        ptr = L.llama_get_logits_ith(self._ctx_handle(), idx)
        if not ptr:
            raise LlamaBackendError(f"llama_get_logits_ith({idx}) returned NULL")
        # A view of the row, kept for its address (llama.cpp's output rows stay put until it
        # reserves more): made anew after each decode, whose weights pushed the interpreter out
        # of the caches, it cost a Gemma token's sampling ~16 µs more (docs/performance.md).
        addr = ctypes.addressof(ptr.contents)
        row = self._rows.get(addr)
        if row is None:
            if len(self._rows) >= 4 * self._n_seq_max:  # rows a reallocated buffer left behind
                self._rows.clear()
            row = self._rows[addr] = np.frombuffer(self._row_type.from_address(addr), dtype=np.float32)
        return row

    @staticmethod
    def _logsumexp(row: np.ndarray) -> float:
        m = float(row.max())
        return m + float(np.log(np.exp(row - m).sum(dtype=np.float64)))

    def _seq_row(self, seq: int) -> np.ndarray:
        idx = self._logits_index(seq)
        return self._given_rows[seq] if idx < 0 else self._row(idx)

    def has_logits(self, seq: int) -> bool:
        return seq in self._logit_idx

    def set_logits(self, seq: int, row: np.ndarray) -> None:
        """``seq``'s last token has these logits (a restored state's, sent with it): the next
        :meth:`logits` / :meth:`sample` of ``seq`` read them, until the next :meth:`decode`."""
        seq = self._check_seq(seq)
        if row.shape != (self._n_vocab,):
            raise LlamaBackendError(f"logits of {row.shape} for a vocabulary of {self._n_vocab}")
        self._given_rows[seq] = np.asarray(row, dtype=np.float32)
        self._logit_idx[seq] = -1

    def logits(self, seq: int, copy: bool = False) -> np.ndarray:
        """float32[n_vocab] logits of ``seq``'s last token of the last :meth:`decode`; without
        ``copy`` a view of llama.cpp's buffer, valid until the next decode."""
        row = self._seq_row(seq)
        return row.copy() if copy else row

    def token_logprob(self, seq: int, tok: int) -> float:
        """log softmax(raw logits of ``seq``)[tok]."""
        row = self._seq_row(seq)
        return float(row[int(tok)]) - self._logsumexp(row)

    @overload
    def sample(self, seq: int, sampler: Sampler, want_logprob: Literal[False] = False) -> int: ...
    @overload
    def sample(self, seq: int, sampler: Sampler, want_logprob: Literal[True]) -> tuple[int, float]: ...

    def sample(self, seq: int, sampler: Sampler, want_logprob: bool = False) -> int | tuple[int, float]:
        """Sample a token for ``seq`` from the last :meth:`decode` (and let the sampler accept it).
        With a grammar raises :class:`engine.sampling.GrammarExhausted` when it allows no token.
        With ``want_logprob`` returns ``(token, logprob)``, the logprob being the natural-log
        softmax of the *raw* logits (before temperature/penalties) at the chosen token."""
        idx = self._logits_index(seq)
        row = self._seq_row(seq)
        lse = self._logsumexp(row) if want_logprob else 0.0
        if sampler.argmax_only:
            tok = int(row.argmax())  # the method: np.argmax's dispatch is ~1 µs a token more
        elif sampler.plain and idx >= 0:
            tok = int(L.llama_sampler_sample(sampler.handle, self._ctx_handle(), idx))
        else:  # grammar / logit bias / a given row: may raise GrammarExhausted, having accepted nothing
            tok = sample_row(sampler, row)
        if want_logprob:
            return tok, float(row[tok]) - lse
        return tok

    def accept(self, sampler: Sampler, tok: int) -> None:
        """``tok`` written without sampling (a reasoning budget's close tag): the grammar and the
        chain take it as if sampled. A grammar that refuses it ends the generation
        (:class:`engine.sampling.GrammarExhausted`), having taken nothing."""
        accept_forced(sampler, int(tok))

    def top_logprobs(self, seq: int, n: int) -> list[tuple[int, float]]:
        """The ``n`` most likely (token, logprob) of ``seq``'s raw logits, most likely first
        (OpenAI ``top_logprobs``). Call before :meth:`sample`; same row, same logprobs."""
        return top_logprobs(self._seq_row(seq), n)

    def make_sampler(self, params: SamplerParams | None = None) -> Sampler:
        return make_sampler(params, self, spare=self.spare_chains)

    # ---- state (engine.llama_backend.seq_state) ----------------------------------------------
    def state_seq_size(self, seq: int) -> int:
        return seq_state.size(self._ctx_handle(), self._check_seq(seq))

    def state_seq_get(self, seq: int) -> memoryview:
        """Snapshot of ``seq``'s KV cells (restorable into any seq with :meth:`state_seq_set`).

        Returned as a read-only view of the one buffer llama.cpp wrote into — no second copy,
        which matters for multi-hundred-MiB states (peak memory ≈ 1× the state).
        """
        seq = self._check_seq(seq)
        return seq_state.get(self._ctx_handle(), seq)

    def state_seq_get_into(self, seq: int, buf: bytearray | memoryview) -> int:
        """Write ``seq``'s state into ``buf`` (writable, ≥ :meth:`state_seq_size`); returns its length."""
        seq = self._check_seq(seq)
        return seq_state.get_into(self._ctx_handle(), seq, buf)

    def checkpoint_get(self, seq: int, reuse: Buffer | None = None) -> Buffer | memoryview:
        """``seq``'s partial state (``PARTIAL_ONLY``: the recurrent part of a hybrid memory, the
        window part of an iSWA cache): a context checkpoint, as llama-server takes them; written
        into ``reuse`` when it is large enough."""
        seq = self._check_seq(seq)
        return seq_state.get_partial(self._ctx_handle(), seq, reuse)

    def checkpoint_set(self, seq: int, data: bytes | Buffer | memoryview) -> bool:
        """Load a :meth:`checkpoint_get` capture into ``seq``; the cells it does not cover stay."""
        seq = self._check_seq(seq)
        self._logit_idx.pop(seq, None)
        return seq_state.set_partial(self._ctx_handle(), seq, data)

    def state_seq_set(self, seq: int, data: bytes | bytearray | memoryview) -> int:
        """Replace ``seq``'s cells with a snapshot from :meth:`state_seq_get`; returns bytes read.

        ``data`` is read in place (bytes, or a writable contiguous buffer such as a bytearray
        slice) — never copied. The sequence is cleared first; raises :class:`StateError` if
        llama.cpp rejects the data.
        """
        seq = self._check_seq(seq)
        ctx = self._ctx_handle()
        self._logit_idx.pop(seq, None)
        return seq_state.restore(ctx, self._mem, seq, data)

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
from typing import Any, Callable, Literal, Sequence, overload

import numpy as np

import llama_cpp.llama_cpp as L

from ..backend import BatchItem
from ..chat.formats import ChatFormat, detect_format
from ..kv_cache import KvCacheInfo
from ..sampling import SamplerParams
from . import vocab
from .batch import LlamaBatch
from .chat_template import ChatTemplate
from .grammar_sampler import accept_forced, sample_row
from .identity import chat_template_source, read_identity
from .kv_probe import describe
from .legacy_chat import is_jinja_source, render_builtin
from .runtime import (
    DecodeError,
    LlamaBackendError,
    StateError,
    clear_llama_errors,
    default_threads,
    ensure_backend,
    last_llama_errors,
)
from .sampler import Sampler, make_sampler, top_logprobs
from ..utf8 import utf8_masks


def _set_fields(params: Any, extra: dict[str, Any] | None, struct_name: str) -> None:
    names = {f[0] for f in type(params)._fields_}
    for k, v in (extra or {}).items():
        if k not in names:
            raise ValueError(f"unknown {struct_name} field {k!r}")
        setattr(params, k, v)


def _report(progress: Callable[[float], None], share: float) -> bool:
    """llama.cpp's progress callback: never abort the load, and never let an exception into C."""
    try:
        progress(float(share))
    except Exception:  # pragma: no cover - a reporting bug must not fail the load
        pass
    return True


class LoadedModel:
    """``n_ctx`` is the total context, ``n_seq_max`` the slots; with ``kv_unified`` (the
    default) the sequences share ``n_ctx`` cells and each may grow up to ``n_ctx`` tokens as
    long as the total fits, without it each gets ``n_ctx / n_seq_max`` (llama.cpp's rule; a
    slot's limit is :attr:`n_ctx_slot`). ``before_context`` sees the loaded model before the
    context is allocated and may refuse it by raising.

    Implements :class:`engine.backend.ModelBackend`. Not thread-safe.
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
    ) -> None:
        self._model = None
        self._ctx = None
        self._batch: LlamaBatch | None = None
        self._closed = False
        self._kv_cache: KvCacheInfo | None = None
        self.tensor_overrides: tuple[dict[str, Any], ...] = ()  # what -ot / --n-cpu-moe moved (build.load)
        self.gpu_offload: Any = None  # engine.gpu.Offload: where the layers went (build.load)
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        self.model_path = path
        ensure_backend()

        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = int(n_gpu_layers)
        _set_fields(mparams, extra_model_params, "llama_model_params")
        if progress is not None:
            callback = L.llama_progress_callback(lambda share, _user: _report(progress, share))
            mparams.progress_callback = callback  # referenced until the load returns
        clear_llama_errors()
        model = L.llama_model_load_from_file(os.fsencode(path), mparams)
        if not model:
            raise LlamaBackendError(f"failed to load model {path}: {'; '.join(last_llama_errors()) or 'unknown error'}")
        self._model = model

        try:
            if before_context is not None:
                before_context(model)
            nt = int(n_threads) if n_threads and n_threads > 0 else default_threads()
            cparams = L.llama_context_default_params()
            cparams.n_ctx = int(n_ctx)
            cparams.n_batch = int(n_batch)
            cparams.n_ubatch = min(int(n_batch), 512)
            cparams.n_seq_max = int(n_seq_max)
            cparams.n_threads = nt
            cparams.n_threads_batch = int(n_threads_batch) if n_threads_batch and n_threads_batch > 0 else nt
            cparams.kv_unified = bool(kv_unified)
            cparams.no_perf = True
            _set_fields(cparams, extra_ctx_params, "llama_context_params")
            self.cparams = cparams
            ctx = L.llama_init_from_model(model, cparams)
            if not ctx:
                raise LlamaBackendError(
                    f"failed to create a context for {path}: {'; '.join(last_llama_errors()) or 'unknown error'}"
                )
            self._ctx = ctx
            self._mem = L.llama_get_memory(ctx)
            self._vocab = L.llama_model_get_vocab(model)
            self._n_vocab = int(L.llama_vocab_n_tokens(self._vocab))
            self._n_ctx = int(L.llama_n_ctx(ctx))
            self._n_batch = int(L.llama_n_batch(ctx))
            self._n_seq_max = int(L.llama_n_seq_max(ctx))
            n_slot = int(L.llama_n_ctx_seq(ctx))  # llama-server's n_ctx_slot()
            if n_ctx_slot_cap > 0:
                n_slot = min(n_slot, int(n_ctx_slot_cap))
            self._n_ctx_slot = min(n_slot, int(L.llama_model_n_ctx_train(model)))
            self.n_threads = nt
            self._threads_now = nt
            # one reusable batch: n_batch tokens, each with room for n_seq_max seq ids
            self._batch = LlamaBatch(self._n_batch, self._n_seq_max)
            self._logit_idx: dict[int, int] = {}
            self._identity = read_identity(model, self._vocab, path, self._n_vocab)
            template = chat_template if chat_template is not None else chat_template_source(model)
            # llama.cpp's own formats: --no-jinja, or a template that names one ("chatml")
            self._builtin_template = template if template and (not jinja or not is_jinja_source(template)) else None
            self.chat = ChatTemplate(None if self._builtin_template else template, self._identity["architecture"])
            self.chat_kwargs = dict(chat_kwargs or {})
            if chat_template is not None:  # one given by the operator or a CONFIGURE (llama-server
                self._check_chat_template()  # refuses an unsupported --chat-template at start too)
            self._chat_syntax: ChatFormat | None = None
            self._utf8_masks: np.ndarray | None = None
            self._pieces: list[bytes] | None = None
        except BaseException:
            self.close()
            raise

    def _check_chat_template(self) -> None:
        """A template that cannot work fails the build, not the first chat: a jinja source is
        compiled; a built-in name (``chatml``; --no-jinja) is tried on one message, as
        llama.cpp then looks the name up."""
        try:
            if self._builtin_template:
                render_builtin(self._builtin_template, [{"role": "user", "content": "hi"}], True)
            else:
                self.chat.compile()
        except LlamaBackendError as e:
            raise LlamaBackendError(f"chat template: {e}") from None
        except Exception as e:  # jinja2's TemplateError and what its compiler raises
            raise LlamaBackendError(f"chat template does not compile: {type(e).__name__}: {e}") from None

    # ---- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Free the batch, the context and the model. Idempotent."""
        if self._closed:
            return
        self._closed = True
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

    def _voc(self) -> Any:
        if self._closed:
            raise LlamaBackendError("model is closed")
        return self._vocab

    # ---- properties --------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self._n_vocab

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
            self._kv_cache = describe(self, dict(os.environ))
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
    def bos(self) -> int:
        return int(L.llama_vocab_bos(self._voc()))

    @property
    def eos(self) -> int:
        return int(L.llama_vocab_eos(self._voc()))

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

    # ---- tokenization ------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> tokens. ``add_special`` adds BOS (if the model wants it); ``parse_special``
        turns special-token text like ``<s>`` / ``<start_of_turn>`` into those tokens."""
        return vocab.tokenize(self._voc(), text, add_special, parse_special)

    def token_to_piece(self, tok: int, special: bool = False) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 sequence). Control tokens give
        b"" unless ``special``."""
        return vocab.token_to_piece(self._voc(), tok, special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        """Tokens -> raw bytes. Control tokens are dropped unless ``special``."""
        return vocab.detokenize(self._voc(), tokens, special)

    def is_eog(self, tok: int) -> bool:
        return bool(L.llama_vocab_is_eog(self._voc(), int(tok)))

    # ---- chat template -----------------------------------------------------------------
    @property
    def chat_format(self) -> str:
        return "builtin" if self._builtin_template else self.chat.format

    def _piece_text(self, tok: int) -> str:
        return self.token_to_piece(tok, special=True).decode("utf-8", "replace") if tok >= 0 else ""

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` to prompt text (see :class:`ChatTemplate`).

        Tokenize the result with ``parse_special=True``; :meth:`chat_tokens` does that and
        avoids a doubled BOS when the template itself emits one.
        """
        if self._builtin_template:
            return render_builtin(self._builtin_template, messages, add_generation_prompt)
        return self.chat.render(messages, add_generation_prompt, bos_token=self._piece_text(self.bos),
                                eos_token=self._piece_text(self.eos), **{**self.chat_kwargs, **extra})

    @property
    def chat_syntax(self) -> ChatFormat:
        """The template's tool-call and reasoning format (``engine.chat.formats``)."""
        if self._chat_syntax is None:
            self._chat_syntax = detect_format(self._builtin_template or self.chat.source)
        return self._chat_syntax

    def utf8_masks(self) -> np.ndarray:
        """bool[4, n_vocab]: row k says which tokens keep the text valid UTF-8 when it ends
        with k continuation bytes still owed. llama.cpp's grammar decodes a character from its
        lead byte alone, so without this a grammar lets a model write invalid text (and a JSON
        string longer than its maxLength once decoded). Computed on first use."""
        if self._utf8_masks is None:
            self._utf8_masks = utf8_masks(self.token_pieces())
        return self._utf8_masks

    def token_pieces(self) -> list[bytes]:
        """Every token's bytes (special tokens' text included), by id; computed on first use
        (a grammar reads them for every candidate it refines)."""
        if self._pieces is None:
            self._pieces = [self.token_to_piece(t, special=True) for t in range(self.n_vocab)]
        return self._pieces

    def render_chat(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        """The prompt text for ``messages`` with the generation prompt; ``extra`` are template
        variables (``tools``, the request's ``chat_template_kwargs``)."""
        return self.apply_chat_template(messages, True, **extra)

    def chat_tokens(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """:meth:`apply_chat_template` + :meth:`chat_text_tokens`."""
        return self.chat_text_tokens(self.apply_chat_template(messages, add_generation_prompt, **extra))

    def chat_text_tokens(self, text: str) -> list[int]:
        """Rendered chat text → tokens (parse_special) with exactly one leading BOS when the
        model adds BOS (a template may emit one itself)."""
        toks = self.tokenize(text, add_special=True, parse_special=True)
        bos = self.bos
        if bos >= 0 and len(toks) >= 2 and toks[0] == bos and toks[1] == bos:
            toks = toks[1:]
        return toks

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
        if not items:
            return
        ctx = self._ctx_handle()
        out = self._batch.fill(items, keep_order)  # keep_order: only to measure it (LlamaBatch.fill)
        clear_llama_errors()
        rc = int(L.llama_decode(ctx, self._batch.raw))
        if rc != 0:
            raise DecodeError(rc, self._decode_error_message(rc, items))
        self._logit_idx = out

    def _decode_error_message(self, rc: int, items: Sequence[BatchItem]) -> str:
        what = {1: "no KV slot for the batch (context full)", 2: "aborted", -1: "invalid batch"}.get(
            rc, "fatal error"
        )
        detail = ", ".join(
            f"seq {it.seq}: {len(it.tokens)} tok at pos {it.pos0} (cache pos_max {self.seq_pos_max(it.seq)})"
            for it in items[:8]
        )
        logs = "; ".join(last_llama_errors(3))
        return f"llama_decode failed with {rc} ({what}); {detail}" + (f"; llama.cpp: {logs}" if logs else "")

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
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def _row_logsumexp(self, idx: int) -> float:
        row = self._row(idx)
        m = float(row.max())
        return m + float(np.log(np.exp(row - m).sum(dtype=np.float64)))

    def has_logits(self, seq: int) -> bool:
        return seq in self._logit_idx

    def logits(self, seq: int, copy: bool = False) -> np.ndarray:
        """float32[n_vocab] logits of ``seq``'s last token of the last :meth:`decode`.

        Without ``copy`` this is a view of llama.cpp's buffer, valid until the next decode.
        """
        row = self._row(self._logits_index(seq))
        return row.copy() if copy else row

    def token_logprob(self, seq: int, tok: int) -> float:
        """log softmax(raw logits of ``seq``)[tok]."""
        idx = self._logits_index(seq)
        return float(self._row(idx)[int(tok)]) - self._row_logsumexp(idx)

    @overload
    def sample(self, seq: int, sampler: Sampler, want_logprob: Literal[False] = False) -> int: ...
    @overload
    def sample(self, seq: int, sampler: Sampler, want_logprob: Literal[True]) -> tuple[int, float]: ...

    def sample(self, seq: int, sampler: Sampler, want_logprob: bool = False) -> int | tuple[int, float]:
        """Sample a token for ``seq`` from the last :meth:`decode` (and let the sampler accept it).

        With a grammar raises :class:`engine.sampling.GrammarExhausted` when it allows no token.

        With ``want_logprob`` returns ``(token, logprob)``, the logprob being the natural-log
        softmax of the *raw* logits (before temperature/penalties) at the chosen token.
        """
        idx = self._logits_index(seq)
        lse = self._row_logsumexp(idx) if want_logprob else 0.0
        if sampler.plain:
            tok = int(L.llama_sampler_sample(sampler.handle, self._ctx_handle(), idx))
        else:  # grammar / logit bias: may raise GrammarExhausted, having accepted nothing
            tok = sample_row(sampler, self._row(idx))
        if want_logprob:
            return tok, float(self._row(idx)[tok]) - lse
        return tok

    def accept(self, sampler: Sampler, tok: int) -> None:
        """``tok`` written without sampling (a reasoning budget's close tag): the grammar and the
        chain take it as if sampled. A grammar that refuses it ends the generation
        (:class:`engine.sampling.GrammarExhausted`), having taken nothing."""
        accept_forced(sampler, int(tok))

    def top_logprobs(self, seq: int, n: int) -> list[tuple[int, float]]:
        """The ``n`` most likely (token, logprob) of ``seq``'s raw logits, most likely first
        (OpenAI ``top_logprobs``). Call before :meth:`sample`; same row, same logprobs."""
        return top_logprobs(self._row(self._logits_index(seq)), n)

    def make_sampler(self, params: SamplerParams | None = None) -> Sampler:
        return make_sampler(params, self)

    # ---- state -------------------------------------------------------------------------
    def state_seq_size(self, seq: int) -> int:
        return int(L.llama_state_seq_get_size(self._ctx_handle(), self._check_seq(seq)))

    def state_seq_get(self, seq: int) -> memoryview:
        """Snapshot of ``seq``'s KV cells (restorable into any seq with :meth:`state_seq_set`).

        Returned as a read-only view of the one buffer llama.cpp wrote into — no second copy,
        which matters for multi-hundred-MiB states (peak memory ≈ 1× the state).
        """
        seq = self._check_seq(seq)
        ctx = self._ctx_handle()
        size = int(L.llama_state_seq_get_size(ctx, seq))
        buf = (ctypes.c_uint8 * max(size, 1))()
        n = int(L.llama_state_seq_get_data(ctx, buf, size, seq))
        return memoryview(buf).cast("B")[:n].toreadonly()

    def state_seq_get_into(self, seq: int, buf: bytearray | memoryview) -> int:
        """Write ``seq``'s state into ``buf`` (writable, ≥ :meth:`state_seq_size`); returns its length."""
        seq = self._check_seq(seq)
        mv = memoryview(buf).cast("B")
        dst = (ctypes.c_uint8 * len(mv)).from_buffer(mv)
        return int(L.llama_state_seq_get_data(self._ctx_handle(), dst, len(mv), seq))

    def checkpoint_get(self, seq: int) -> bytes:
        """``seq``'s partial state (``PARTIAL_ONLY``: the recurrent part of a hybrid memory, the
        window part of an iSWA cache): a context checkpoint, as llama-server takes them."""
        seq = self._check_seq(seq)
        ctx, flags = self._ctx_handle(), L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(L.llama_state_seq_get_size_ext(ctx, seq, flags))
        buf = (ctypes.c_uint8 * max(size, 1))()
        n = int(L.llama_state_seq_get_data_ext(ctx, buf, size, seq, flags))
        return bytes(memoryview(buf).cast("B")[:n])

    def checkpoint_set(self, seq: int, data: bytes) -> bool:
        """Load a :meth:`checkpoint_get` capture into ``seq``; the cells it does not cover stay."""
        seq = self._check_seq(seq)
        self._logit_idx.pop(seq, None)
        src = ctypes.cast(data, ctypes.POINTER(ctypes.c_uint8))
        clear_llama_errors()
        return int(L.llama_state_seq_set_data_ext(self._ctx_handle(), src, len(data), seq,
                                                 L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)) > 0

    def state_seq_set(self, seq: int, data: bytes | bytearray | memoryview) -> int:
        """Replace ``seq``'s cells with a snapshot from :meth:`state_seq_get`; returns bytes read.

        ``data`` is read in place (bytes, or a writable contiguous buffer such as a bytearray
        slice) — never copied. The sequence is cleared first; raises :class:`StateError` if
        llama.cpp rejects the data.
        """
        seq = self._check_seq(seq)
        ctx = self._ctx_handle()
        L.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._logit_idx.pop(seq, None)
        n_bytes = len(data) if not isinstance(data, memoryview) else data.nbytes
        if not n_bytes:
            return 0
        # No ctypes.cast of a ctypes object: it links the object and its cast in a reference cycle
        # (each keeps the other in ``_objects``), and the cycle would keep the caller's buffer
        # — hundreds of MiB — alive until the cyclic GC runs. A bytes object is cast by address
        # (kept alive by ``data`` during the call); a c_uint8 array passes as the pointer itself.
        if isinstance(data, bytes):
            src = ctypes.cast(data, ctypes.POINTER(ctypes.c_uint8))
        else:
            mv = memoryview(data).cast("B")
            if mv.readonly:
                mv = memoryview(bytearray(mv))  # rare: a read-only view must be copied once
            src = (ctypes.c_uint8 * n_bytes).from_buffer(mv)
        clear_llama_errors()
        n = int(L.llama_state_seq_set_data(ctx, src, n_bytes, seq))
        if n == 0:
            L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            logs = "; ".join(last_llama_errors(3))
            raise StateError(
                f"llama_state_seq_set_data rejected {n_bytes} bytes for seq {seq}"
                + (f": {logs}" if logs else "")
            )
        return n


"""Thin synchronous wrapper over llama-cpp-python's low-level ctypes API.

Everything here blocks; there is no asyncio in this module. The intended use is one
:class:`LoadedModel` driven from ONE inference thread (see :func:`make_inference_executor`)
by an asyncio actor. ctypes releases the GIL during every foreign call, so the event loop
keeps running while ``llama_decode`` computes.

Core of continuous batching: :meth:`LoadedModel.decode` puts the tokens of several sequences
(slots) into ONE ``llama_batch`` and calls ``llama_decode`` once; afterwards
:meth:`LoadedModel.logits` / :meth:`LoadedModel.sample` read the output row of each sequence.

Built against llama-cpp-python 0.3.36 (llama.cpp ``llama_memory_*`` API; the old
``llama_kv_self_*`` functions no longer exist).
"""
from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import hashlib
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence, overload

import numpy as np

import llama_cpp.llama_cpp as L

__all__ = [
    "CAP_MTP",
    "CAP_VISION",
    "CAP_REASONING",
    "CAP_TOOL_USE",
    "CAP_CODE",
    "LlamaBackendError",
    "DecodeError",
    "StateError",
    "check_rpc_support",
    "set_llama_logging",
    "last_llama_errors",
    "BatchItem",
    "LoadedModel",
    "SamplerParams",
    "Sampler",
    "make_sampler",
    "make_inference_executor",
]

# model_capabilities bits
CAP_MTP = 1 << 0
CAP_VISION = 1 << 1
CAP_REASONING = 1 << 2
CAP_TOOL_USE = 1 << 3
CAP_CODE = 1 << 4

LLAMA_DEFAULT_SEED = 0xFFFFFFFF


class LlamaBackendError(RuntimeError):
    """Base class of this module's errors."""


class DecodeError(LlamaBackendError):
    """``llama_decode`` returned non-zero.

    ``code``: 1 = no KV slot (context full), 2 = aborted, -1 = invalid batch, < -1 fatal.
    After a failed decode no logits are available (:meth:`LoadedModel.logits` raises).
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class StateError(LlamaBackendError):
    """Restoring a sequence state failed."""


# --------------------------------------------------------------------------------------
# logging: silent by default, but keep the last warnings/errors for error messages
# --------------------------------------------------------------------------------------
_GGML_LOG_WARN, _GGML_LOG_ERROR, _GGML_LOG_CONT = 3, 4, 5  # ggml.h enum ggml_log_level
_recent_errors: collections.deque[str] = collections.deque(maxlen=16)
_log_state = {"verbose": False, "last_level": 0}


def _log_cb_impl(level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
    try:
        if level != _GGML_LOG_CONT:
            _log_state["last_level"] = level
        eff = _log_state["last_level"]
        s = text.decode("utf-8", "replace") if text else ""
        if eff in (_GGML_LOG_WARN, _GGML_LOG_ERROR) and s.strip():
            _recent_errors.append(s.rstrip("\n"))
        if _log_state["verbose"]:
            sys.stderr.write(s)
            sys.stderr.flush()
    except Exception:  # never raise into C
        pass


# keep a module-level reference: llama.cpp stores the raw function pointer
_LOG_CALLBACK = L.llama_log_callback(_log_cb_impl)
L.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def set_llama_logging(verbose: bool) -> None:
    """Write llama.cpp/ggml log lines to stderr (True) or drop them (False, the default).

    Warnings and errors are always kept in a small ring buffer (:func:`last_llama_errors`).
    """
    _log_state["verbose"] = bool(verbose)


def last_llama_errors(n: int = 4) -> list[str]:
    """The last ``n`` warning/error lines llama.cpp logged (for error messages)."""
    return list(_recent_errors)[-n:]


def check_rpc_support() -> None:
    """Raise RuntimeError unless llama-cpp-python was built with ``-DGGML_RPC=ON``."""
    if not L.llama_supports_rpc():
        raise RuntimeError(
            "llama-cpp-python was built without ggml RPC support: reinstall it with "
            "CMAKE_ARGS='-DGGML_RPC=ON -DGGML_NATIVE=OFF' (see scripts/install_llama_cpp.sh; "
            "pass --no-cache-dir, pip's wheel cache ignores CMAKE_ARGS)"
        )


_backend_lock = threading.Lock()
_backend_initialized = False


def _ensure_backend() -> None:
    global _backend_initialized
    with _backend_lock:
        if not _backend_initialized:
            L.llama_backend_init()
            _backend_initialized = True


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


# LLAMA_FTYPE_* value -> short name ("F32", "Q8_0", "Q4_K_M", ...)
_FTYPE_NAMES: dict[int, str] = {}
for _n in dir(L):
    if _n.startswith("LLAMA_FTYPE_") and _n != "LLAMA_FTYPE_GUESSED":
        _v = getattr(L, _n)
        if isinstance(_v, int):
            _FTYPE_NAMES.setdefault(_v, _n.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_"))


def ftype_name(ftype: int) -> str:
    """Name of a ``llama_ftype`` value, e.g. 15 -> "Q4_K_M"."""
    return _FTYPE_NAMES.get(int(ftype) & ~1024, f"FTYPE_{int(ftype)}")


# --------------------------------------------------------------------------------------
# batching
# --------------------------------------------------------------------------------------
@dataclass(slots=True)
class BatchItem:
    """Tokens of one sequence for one :meth:`LoadedModel.decode` step.

    ``pos0`` is the position of the first token (= ``seq_pos_max(seq) + 1`` for a
    continuation). With ``logits_last`` the logits of the last token are computed and can
    be read with :meth:`LoadedModel.logits` / sampled with :meth:`LoadedModel.sample`.
    """

    seq: int
    tokens: Sequence[int]
    pos0: int
    logits_last: bool = True


# --------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------
@dataclass
class SamplerParams:
    """Sampling parameters. ``temperature <= 0`` means greedy (argmax)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None  # None: a random seed
    penalty_repeat: float = 1.0  # 1.0 = off
    penalty_last_n: int = 64
    penalty_freq: float = 0.0  # 0.0 = off
    penalty_present: float = 0.0  # 0.0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalties_enabled(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.penalty_repeat != 1.0 or self.penalty_freq != 0.0 or self.penalty_present != 0.0
        )


class Sampler:
    """A llama.cpp sampler chain. Not thread-safe; one per generating sequence.

    :meth:`sample` samples from the remembered output row of ``seq`` and also *accepts* the
    token (updates the penalty history), as ``llama_sampler_sample`` does. Use
    :meth:`accept` only for tokens that were not sampled, e.g. the prompt, if repetition
    penalties should see them.
    """

    def __init__(self, chain: Any, params: SamplerParams) -> None:
        self._chain = chain
        self.params = params

    @property
    def handle(self) -> Any:
        if self._chain is None:
            raise LlamaBackendError("sampler was freed")
        return self._chain

    @overload
    def sample(self, model: "LoadedModel", seq: int, want_logprob: Literal[False] = False) -> int: ...
    @overload
    def sample(self, model: "LoadedModel", seq: int, want_logprob: Literal[True]) -> tuple[int, float]: ...

    def sample(self, model: "LoadedModel", seq: int, want_logprob: bool = False) -> int | tuple[int, float]:
        """Sample a token for ``seq`` from the last :meth:`LoadedModel.decode`.

        With ``want_logprob`` returns ``(token, logprob)``, the logprob being the natural-log
        softmax of the *raw* logits (before temperature/penalties) at the chosen token.
        """
        idx = model._logits_index(seq)
        lse = model._row_logsumexp(idx) if want_logprob else 0.0
        tok = int(L.llama_sampler_sample(self.handle, model._ctx_handle(), idx))
        if want_logprob:
            return tok, float(model._row(idx)[tok]) - lse
        return tok

    def accept(self, token: int) -> None:
        L.llama_sampler_accept(self.handle, int(token))

    def accept_many(self, tokens: Iterable[int]) -> None:
        h = self.handle
        for t in tokens:
            L.llama_sampler_accept(h, int(t))

    def reset(self) -> None:
        L.llama_sampler_reset(self.handle)

    def free(self) -> None:
        if self._chain is not None:
            L.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.free()
        except Exception:
            pass


def make_sampler(
    params: SamplerParams | None = None,
    model: "LoadedModel | None" = None,
    *,
    n_vocab: int | None = None,
) -> Sampler:
    """Build a sampler chain: [penalties] + (greedy | top_k, top_p, min_p, temp, dist(seed)).

    The penalties sampler of this llama.cpp version needs the vocabulary size: pass ``model``
    (or ``n_vocab``) when penalties are enabled.
    """
    p = params or SamplerParams()
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if not chain:
        raise LlamaBackendError("llama_sampler_chain_init failed")
    try:
        if p.penalties_enabled:
            nv = n_vocab if n_vocab is not None else (model.n_vocab if model is not None else None)
            if nv is None:
                raise ValueError("repetition penalties need the vocabulary size: pass model= or n_vocab=")
            L.llama_sampler_chain_add(
                chain,
                L.llama_sampler_init_penalties(
                    int(nv), int(p.penalty_last_n), float(p.penalty_repeat), float(p.penalty_freq),
                    float(p.penalty_present),
                ),
            )
        if p.greedy:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        else:
            if p.top_k > 0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(int(p.top_k)))
            if 0.0 < p.top_p < 1.0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(float(p.top_p), 1))
            if p.min_p > 0.0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(float(p.min_p), 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(float(p.temperature)))
            seed = LLAMA_DEFAULT_SEED if p.seed is None else int(p.seed) & 0xFFFFFFFF
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))
    except BaseException:
        L.llama_sampler_free(chain)
        raise
    return Sampler(chain, p)


# --------------------------------------------------------------------------------------
# model + context
# --------------------------------------------------------------------------------------
_GEMMA_FALLBACK = "gemma"
_GENERIC_FALLBACK = "generic"


def _content_text(content: Any) -> str:
    """OpenAI-style message content (str or list of parts) -> plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                out.append(str(part.get("text", "")))
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return str(content)


class LoadedModel:
    """One llama.cpp model plus one context with ``n_seq_max`` sequences (slots).

    The KV cache is unified (``kv_unified=True``): the sequences share ``n_ctx`` cells and
    each one may grow up to ``n_ctx`` tokens as long as the total fits.

    Not thread-safe: call everything from one thread (the inference thread).
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
    ) -> None:
        self._model = None
        self._ctx = None
        self._batch = None
        self._closed = False
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        self.model_path = path
        _ensure_backend()

        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = int(n_gpu_layers)
        for k, v in (extra_model_params or {}).items():
            if k not in {f[0] for f in L.llama_model_params._fields_}:
                raise ValueError(f"unknown llama_model_params field {k!r}")
            setattr(mparams, k, v)
        _recent_errors.clear()
        model = L.llama_model_load_from_file(os.fsencode(path), mparams)
        if not model:
            raise LlamaBackendError(f"failed to load model {path}: {'; '.join(last_llama_errors()) or 'unknown error'}")
        self._model = model

        try:
            nt = int(n_threads) if n_threads else _default_threads()
            cparams = L.llama_context_default_params()
            cparams.n_ctx = int(n_ctx)
            cparams.n_batch = int(n_batch)
            cparams.n_ubatch = min(int(n_batch), 512)
            cparams.n_seq_max = int(n_seq_max)
            cparams.n_threads = nt
            cparams.n_threads_batch = nt
            cparams.kv_unified = True
            cparams.no_perf = True
            for k, v in (extra_ctx_params or {}).items():
                if k not in {f[0] for f in L.llama_context_params._fields_}:
                    raise ValueError(f"unknown llama_context_params field {k!r}")
                setattr(cparams, k, v)
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
            self.n_threads = nt

            # one reusable batch: n_batch tokens, each with room for n_seq_max seq ids
            self._cap = 0
            self._alloc_batch(self._n_batch)
            self._logit_idx: dict[int, int] = {}

            self._identity = self._build_identity()
            self._template_src = self._chat_template_source()
            self._template = None  # compiled lazily
        except BaseException:
            self.close()
            raise

    # ---- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Free the batch, the context and the model. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._batch is not None:
            L.llama_batch_free(self._batch)
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
    def n_ctx(self) -> int:
        """KV cells of the context (shared by all sequences; the limit per sequence too)."""
        return self._n_ctx

    @property
    def n_seq_max(self) -> int:
        return self._n_seq_max

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
        """model_path, model_name, tokenizer, model_quant, model_capabilities,
        model_sha256_prefix (None for files > 64 MiB until :meth:`compute_sha256_prefix`),
        n_params, size_bytes (file size), plus architecture/n_ctx_train/n_layer/n_embd/tensor_bytes."""
        return dict(self._identity)

    def meta(self, key: str) -> str | None:
        """GGUF metadata value as a string (None if absent)."""
        if self._model is None:
            raise LlamaBackendError("model is closed")
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = L.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", "replace")
            size = n + 1

    def compute_sha256_prefix(self, n_hex: int = 16) -> str:
        """sha256 of the model file (first ``n_hex`` hex digits); cached in :attr:`identity`."""
        h = hashlib.sha256()
        with open(self.model_path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        pfx = h.hexdigest()[:n_hex]
        self._identity["model_sha256_prefix"] = pfx
        return pfx

    def _build_identity(self) -> dict[str, Any]:
        model = self._model
        arch = self.meta("general.architecture") or ""
        name = self.meta("general.name") or self.model_path.stem
        tok_model = self.meta("tokenizer.ggml.model") or "unknown"
        ft = self.meta("general.file_type")
        quant = ftype_name(int(ft)) if ft is not None and ft.lstrip("-").isdigit() else ftype_name(
            L.llama_model_ftype(model)
        )
        tmpl = (L.llama_model_chat_template(model, None) or b"").decode("utf-8", "replace")
        caps = 0
        if int(L.llama_model_n_layer_nextn(model)) > 0:
            caps |= CAP_MTP
        if "<think>" in tmpl or "enable_thinking" in tmpl or "reasoning_content" in tmpl:
            caps |= CAP_REASONING
        if "tools" in tmpl or "tool_calls" in tmpl:
            caps |= CAP_TOOL_USE
        if int(L.llama_vocab_fim_pre(self._vocab)) >= 0 and int(L.llama_vocab_fim_suf(self._vocab)) >= 0:
            caps |= CAP_CODE  # fill-in-the-middle tokens: a code model
        size = self.model_path.stat().st_size
        ident: dict[str, Any] = {
            "model_path": str(self.model_path),
            "model_name": name,
            "tokenizer": f"{tok_model}/{self._n_vocab}",
            "model_quant": quant,
            "model_capabilities": caps,
            "model_sha256_prefix": None,
            "n_params": int(L.llama_model_n_params(model)),
            "size_bytes": size,
            "tensor_bytes": int(L.llama_model_size(model)),
            "architecture": arch,
            "n_ctx_train": int(L.llama_model_n_ctx_train(model)),
            "n_layer": int(L.llama_model_n_layer(model)),
            "n_embd": int(L.llama_model_n_embd(model)),
        }
        self._identity = ident
        if size <= 64 << 20:
            self.compute_sha256_prefix()
        return ident

    # ---- tokenization ------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> tokens. ``add_special`` adds BOS (if the model wants it); ``parse_special``
        turns special-token text like ``<s>`` / ``<start_of_turn>`` into those tokens."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        n_max = len(data) + 8
        while True:
            buf = (L.llama_token * n_max)()
            n = L.llama_tokenize(self._voc(), data, len(data), buf, n_max, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            if -n <= n_max:  # pragma: no cover - defensive
                raise LlamaBackendError(f"llama_tokenize failed ({n})")
            n_max = -n

    def token_to_piece(self, tok: int, special: bool = False) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 sequence). Control tokens give
        b"" unless ``special``."""
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = L.llama_token_to_piece(self._voc(), int(tok), buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        """Tokens -> raw bytes. Control tokens are dropped unless ``special``."""
        if not tokens:
            return b""
        arr = (L.llama_token * len(tokens))(*tokens)
        size = max(64, len(tokens) * 8)
        while True:
            buf = ctypes.create_string_buffer(size)
            n = L.llama_detokenize(self._voc(), arr, len(tokens), buf, size, False, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def is_eog(self, tok: int) -> bool:
        return bool(L.llama_vocab_is_eog(self._voc(), int(tok)))

    # ---- chat template -----------------------------------------------------------------
    def _chat_template_source(self) -> str | None:
        raw = L.llama_model_chat_template(self._model, None)
        if raw:
            return raw.decode("utf-8", "replace")
        return None

    @property
    def chat_template(self) -> str | None:
        """The GGUF's ``tokenizer.chat_template`` (None if it has none)."""
        return self._template_src

    @property
    def chat_format(self) -> str:
        """"jinja" (GGUF template), "gemma" (fallback for gemma3) or "generic" (fallback)."""
        if self._template_src:
            return "jinja"
        if self._identity.get("architecture", "").startswith("gemma"):
            return _GEMMA_FALLBACK
        return _GENERIC_FALLBACK

    def _piece_text(self, tok: int) -> str:
        if tok < 0:
            return ""
        return self.token_to_piece(tok, special=True).decode("utf-8", "replace")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` to prompt text.

        Uses the GGUF chat template (jinja2 ImmutableSandboxedEnvironment, like
        llama-cpp-python's Jinja2ChatFormatter, with ``bos_token``/``eos_token``; ``extra``
        is passed to the template, e.g. ``tools=[...]``). Without a template: gemma-style
        turns for gemma models, else ``<|role|>\\ncontent\\n`` blocks.

        Tokenize the result with ``parse_special=True``; :meth:`chat_tokens` does that and
        avoids a doubled BOS when the template itself emits one.
        """
        fmt = self.chat_format
        if fmt == "jinja":
            if self._template is None:
                self._template = _compile_template(self._template_src or "")
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._piece_text(self.bos),
                eos_token=self._piece_text(self.eos),
                **extra,
            )
        if fmt == _GEMMA_FALLBACK:
            out: list[str] = []
            system = ""
            for m in messages:
                role = m.get("role", "user")
                text = _content_text(m.get("content"))
                if role == "system":
                    system += text + "\n\n"
                    continue
                if role == "assistant":
                    role = "model"
                elif role != "model":
                    role = "user"
                if system and role == "user":
                    text, system = system + text, ""
                out.append(f"<start_of_turn>{role}\n{text}<end_of_turn>\n")
            if system:  # a lone system message
                out.append(f"<start_of_turn>user\n{system.rstrip()}<end_of_turn>\n")
            if add_generation_prompt:
                out.append("<start_of_turn>model\n")
            return "".join(out)
        out = [f"<|{m.get('role', 'user')}|>\n{_content_text(m.get('content'))}\n" for m in messages]
        if add_generation_prompt:
            out.append("<|assistant|>\n")
        return "".join(out)

    def chat_tokens(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """:meth:`apply_chat_template` + tokenize (parse_special) with exactly one leading BOS
        when the model adds BOS."""
        toks = self.tokenize(self.apply_chat_template(messages, add_generation_prompt, **extra),
                             add_special=True, parse_special=True)
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

    def clear_all(self) -> None:
        """Empty the whole KV cache (all sequences)."""
        self._ctx_handle()
        L.llama_memory_clear(self._mem, True)
        self._logit_idx.clear()

    def seq_pos_max(self, seq: int) -> int:
        """Largest position stored for ``seq`` (-1 if empty); the next token goes to +1."""
        return int(L.llama_memory_seq_pos_max(self._mem, self._check_seq(seq)))

    def seq_pos_min(self, seq: int) -> int:
        return int(L.llama_memory_seq_pos_min(self._mem, self._check_seq(seq)))

    def seq_copy(self, src: int, dst: int) -> None:
        """Make ``dst`` a copy of ``src`` (``dst`` is cleared first). Cheap with a unified KV cache."""
        src, dst = self._check_seq(src), self._check_seq(dst)
        if src == dst:
            return
        L.llama_memory_seq_rm(self._mem, dst, -1, -1)
        L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self._logit_idx.pop(dst, None)

    # ---- the batched step ----------------------------------------------------------------
    def _alloc_batch(self, capacity: int) -> None:
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        b = L.llama_batch_init(int(capacity), 0, self._n_seq_max)
        self._batch = b
        self._cap = int(capacity)
        self._tok_np = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self._pos_np = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self._nseq_np = np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))
        self._lg_np = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        self._nseq_np[:] = 1
        self._seq_ptrs = b.seq_id
        self._row_seq = [-1] * capacity  # what we last wrote into seq_id[row][0]

    def decode(self, items: Sequence[BatchItem]) -> None:
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
        total = 0
        for it in items:
            total += len(it.tokens)
        if total > self._n_batch:
            raise ValueError(f"{total} tokens in one decode() exceed n_batch={self._n_batch}; split the prompt")
        if total > self._cap:  # pragma: no cover - capacity is n_batch from the start
            self._alloc_batch(total)
        tok, pos, lg = self._tok_np, self._pos_np, self._lg_np
        row_seq, seq_ptrs = self._row_seq, self._seq_ptrs
        out: dict[int, int] = {}
        seen: set[int] = set()
        nsm = self._n_seq_max
        i = 0
        for it in items:
            seq = it.seq
            k = len(it.tokens)
            if not 0 <= seq < nsm:
                raise ValueError(f"seq {seq} out of range 0..{nsm - 1}")
            if k == 0:
                raise ValueError(f"empty token list for seq {seq}")
            if seq in seen:
                raise ValueError(f"seq {seq} appears twice in one decode()")
            seen.add(seq)
            if k == 1:
                tok[i] = it.tokens[0]
                pos[i] = it.pos0
                lg[i] = 0
                if row_seq[i] != seq:
                    seq_ptrs[i][0] = seq
                    row_seq[i] = seq
            else:
                j = i + k
                tok[i:j] = it.tokens
                pos[i:j] = np.arange(it.pos0, it.pos0 + k, dtype=np.int32)
                lg[i:j] = 0
                for r in range(i, j):
                    if row_seq[r] != seq:
                        seq_ptrs[r][0] = seq
                        row_seq[r] = seq
            if it.logits_last:
                lg[i + k - 1] = 1
                out[seq] = i + k - 1
            i += k
        self._batch.n_tokens = total
        _recent_errors.clear()
        rc = int(L.llama_decode(ctx, self._batch))
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
        """Same as ``sampler.sample(self, seq, want_logprob)``."""
        return sampler.sample(self, seq, want_logprob)  # type: ignore[call-overload]

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
        if isinstance(data, bytes):
            src = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
        else:
            mv = memoryview(data).cast("B")
            if mv.readonly:
                mv = memoryview(bytearray(mv))  # rare: a read-only view must be copied once
            src = ctypes.cast((ctypes.c_uint8 * n_bytes).from_buffer(mv), ctypes.POINTER(ctypes.c_uint8))
        _recent_errors.clear()
        n = int(L.llama_state_seq_set_data(ctx, src, n_bytes, seq))
        if n == 0:
            L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            logs = "; ".join(last_llama_errors(3))
            raise StateError(
                f"llama_state_seq_set_data rejected {n_bytes} bytes for seq {seq}"
                + (f": {logs}" if logs else "")
            )
        return n


def _compile_template(src: str) -> Any:
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        import json

        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: datetime.datetime.now().strftime(f)
    return env.from_string(src)


# --------------------------------------------------------------------------------------
# the inference thread
# --------------------------------------------------------------------------------------
def _lower_thread_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (PermissionError, OSError, AttributeError):
        pass


def make_loader_executor(low_priority: bool = True) -> concurrent.futures.ThreadPoolExecutor:
    """A single-thread executor for building (shadow) models.

    With ``low_priority`` it runs at nice 19 like the inference thread, so a shadow load never
    outranks live generation; the event loop (nice 0) preempts both.
    """
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="hydra-loader",
        initializer=_lower_thread_priority if low_priority else None,
    )


def make_inference_executor(low_priority: bool = True) -> concurrent.futures.ThreadPoolExecutor:
    """A single-thread executor for all llama.cpp calls of one model.

    With ``low_priority`` the worker thread runs at nice 19 (Linux per-thread nice), so the
    event loop stays responsive while ggml's compute threads, which inherit the nice value
    when started from this thread, use every core.
    """
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="hydra-inference",
        initializer=_lower_thread_priority if low_priority else None,
    )
